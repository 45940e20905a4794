"""The run directory: everything a run writes lives under ``runs/<name>/``.

    config.json          the resolved configuration
    metrics.jsonl        one JSON object per iteration (and per held-out evaluation)
    decisions.jsonl      every scaling, migration and release decision (elastic policy)
    ledger.json          worker-seconds and cost per pool, per iteration, per worker
    dashboard.json       the Dask dashboard link, and whether the run has ended
    report.html          ``rlhfless report`` (plots beside it, in report/)
    tb/                  TensorBoard scalars, when tensorboard is installed
    rollouts/iter-N.parquet   every sample of iteration N
    weights/vN.safetensors    the newest published policy versions
    checkpoints/iter-N/       zarr v3 checkpoints, committed atomically (checkpoint.py)

Files are written to a temporary name and renamed into place, so a reader never mistakes
a partial file for a whole one. Every metrics record is also handed to ``listeners`` (a
notebook's live plot, TensorBoard), in the order appended.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .config import Config


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.listeners: list[Callable[[dict], None]] = []

    @classmethod
    def create(cls, cfg: Config, overwrite: bool = False) -> RunDir:
        path = cfg.run_dir
        if path.exists() and any(path.iterdir()):
            if not overwrite:
                raise FileExistsError(
                    f"run directory {path} exists; choose another name (--set name=...) "
                    "or pass --overwrite"
                )
            shutil.rmtree(path)
        (path / "rollouts").mkdir(parents=True, exist_ok=True)
        run = cls(path)
        run.write_json("config.json", cfg.to_dict())
        return run

    @property
    def weights(self) -> Path:
        return self.path / "weights"

    def write_json(self, name: str, obj) -> None:
        tmp = self.path / f".{name}.tmp"
        tmp.write_text(json.dumps(obj, indent=1))
        os.replace(tmp, self.path / name)

    def read_json(self, name: str):
        return json.loads((self.path / name).read_text())

    def append_metrics(self, record: dict) -> None:
        self.append_jsonl("metrics.jsonl", record)
        for listener in self.listeners:
            listener(record)

    def append_jsonl(self, name: str, record: dict) -> None:
        with (self.path / name).open("a") as f:
            f.write(json.dumps(record, default=float) + "\n")

    def metrics(self) -> list[dict]:
        return self.read_jsonl("metrics.jsonl")

    def read_jsonl(self, name: str) -> list[dict]:
        path = self.path / name
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def write_rollouts(self, iteration: int, table: pa.Table) -> Path:
        final = self.path / "rollouts" / f"iter-{iteration:05d}.parquet"
        tmp = final.with_suffix(".tmp")
        pq.write_table(table.replace_schema_metadata(None), tmp)
        os.replace(tmp, final)
        return final
