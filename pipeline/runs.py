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
a partial file for a whole one. JSON lines are appended one record per write; a last line
cut short (a writer killed mid-line) is passed over by ``read_jsonl`` and dropped by
``rewrite_jsonl`` (on resume), so that the next record starts on a fresh line; any other
line that is not JSON is an error naming file and line. Everything written is strict JSON:
a NaN or infinite number is written as ``null`` and its key listed under ``"nonfinite"``.
Every metrics record is also handed to ``listeners`` (a notebook's live plot, TensorBoard),
in the order appended, as it was given.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .config import Config


def _finite(value: Any, key: str, nonfinite: list[str]) -> Any:
    """``value`` with every NaN or infinite float replaced by None (their keys noted)."""
    if isinstance(value, dict):
        return {k: _finite(v, f"{key}.{k}" if key else str(k), nonfinite)
                for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v, key, nonfinite) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        nonfinite.append(key)
        return None
    return value


def dumps(record: Any, indent: int | None = None) -> str:
    """``record`` as strict JSON (numpy scalars as numbers): a NaN or infinite number becomes
    ``null``, and a dict record lists those keys under ``"nonfinite"``."""
    plain = json.loads(json.dumps(record, default=float))  # numpy scalars -> float
    nonfinite: list[str] = []
    clean = _finite(plain, "", nonfinite)
    if nonfinite and isinstance(clean, dict):
        clean["nonfinite"] = sorted(set(nonfinite))
    return json.dumps(clean, indent=indent, allow_nan=False)


def parse_jsonl(path: Path) -> tuple[list[dict], bool]:
    """The records of the JSON-lines file at ``path``, and whether it ends as a whole line
    (empty, or a newline last). A last line with no newline after it that is not JSON (a
    writer killed mid-line) is passed over; any other line that is not JSON raises
    ``ValueError`` naming file and line."""
    text = path.read_text()
    lines = text.split("\n")  # the last item is what follows the last newline
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError as err:
            if number < len(lines):
                raise ValueError(f"{path}:{number}: not a JSON record ({err.msg}); fix or "
                                 "remove that line") from None
    return records, not lines[-1]


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
        tmp.write_text(dumps(obj, indent=1))
        os.replace(tmp, self.path / name)

    def read_json(self, name: str):
        return json.loads((self.path / name).read_text())

    def append_metrics(self, record: dict) -> None:
        self.append_jsonl("metrics.jsonl", record)
        for listener in self.listeners:
            listener(record)

    def append_jsonl(self, name: str, record: dict) -> None:
        with (self.path / name).open("a") as f:
            f.write(dumps(record) + "\n")

    def metrics(self) -> list[dict]:
        return self.read_jsonl("metrics.jsonl")

    def read_jsonl(self, name: str) -> list[dict]:
        """The records of ``name``; a last line cut short is passed over (``parse_jsonl``)."""
        path = self.path / name
        return parse_jsonl(path)[0] if path.exists() else []

    def rewrite_jsonl(self, name: str, keep: Callable[[dict], bool] = lambda r: True) -> None:
        """Rewrite ``name`` with the records ``keep`` accepts, atomically, if that drops a
        record or the file does not end with a whole line; otherwise leave it as it is."""
        path = self.path / name
        if not path.exists():
            return
        records, whole = parse_jsonl(path)
        kept = [r for r in records if keep(r)]
        if not whole or len(kept) != len(records):
            tmp = self.path / f".{name}.tmp"
            tmp.write_text("".join(dumps(r) + "\n" for r in kept))
            os.replace(tmp, path)

    def write_rollouts(self, iteration: int, table: pa.Table) -> Path:
        final = self.path / "rollouts" / f"iter-{iteration:05d}.parquet"
        tmp = final.with_suffix(".tmp")
        pq.write_table(table.replace_schema_metadata(None), tmp)
        os.replace(tmp, final)
        return final
