"""What a run directory holds, read for reports, plots and notebooks (``RunData``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pa_compute
import pyarrow.parquet as pq

from ..durable.runs import RunDir
from .observe import dashboard_status


@dataclass
class RunData:
    """Everything a report or a notebook plots, read from a run directory."""

    path: Path
    config: dict[str, Any]
    iterations: list[dict] = field(default_factory=list)  # metrics, event = "iteration"
    evals: list[dict] = field(default_factory=list)  # metrics, event = "eval"
    decisions: list[dict] = field(default_factory=list)
    ledger: dict | None = None  # ledger.json: written when the run ends
    lengths: dict[int, np.ndarray] = field(default_factory=dict)  # iteration -> tokens
    dashboard: dict | None = None  # dashboard.json + "live"
    traced: tuple[float, float] | None = None  # iterations whose tasks to draw (None: last)

    @classmethod
    def load(cls, path: str | Path) -> RunData:
        run = RunDir(path)
        if not (run.path / "metrics.jsonl").exists():
            raise FileNotFoundError(
                f"{run.path}: not a run directory (no metrics.jsonl); give runs/<name>")
        metrics = run.metrics()
        config = run.read_json("config.json") if (run.path / "config.json").exists() else {}
        data = cls(run.path, config,
                   iterations=[m for m in metrics if m.get("event") == "iteration"],
                   evals=[m for m in metrics if m.get("event") == "eval"],
                   decisions=run.read_jsonl("decisions.jsonl"),
                   dashboard=dashboard_status(run))
        if (run.path / "ledger.json").exists():
            data.ledger = run.read_json("ledger.json")
        for f in sorted((run.path / "rollouts").glob("iter-*.parquet")):
            try:
                column = pq.read_table(f, columns=["response_ids"]).column("response_ids")
            except (pa.ArrowException, OSError) as err:
                raise ValueError(f"{f}: cannot read as Parquet ({' '.join(str(err).split())}); "
                                 "restore it from a copy, or move it away to report without "
                                 "that iteration's lengths") from None
            data.lengths[int(f.stem.split("-")[1])] = pa_compute.list_value_length(column).to_numpy(
                zero_copy_only=False)
        return data

    @property
    def live(self) -> bool:
        return bool(self.dashboard and self.dashboard["live"])
