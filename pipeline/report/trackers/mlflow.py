"""MLflow: a run named as ours, in experiment ``$MLFLOW_EXPERIMENT_NAME`` (default
``rlhfless``) of ``$MLFLOW_TRACKING_URI``; without one, a SQLite store in the run directory
(``<run>/mlflow.db``, artifacts under ``<run>/mlflow-artifacts``), which ``mlflow ui
--backend-store-uri sqlite:///runs/<name>/mlflow.db`` shows. The ``mlflow`` extra is
``mlflow-skinny`` with SQLAlchemy and Alembic, which its SQL store needs.

The config goes in as the run's params (nested keys joined by ``/``); metrics with their step;
the report folder as the artifacts ``report/...``; the run ends FINISHED or FAILED."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunStatus
from mlflow.tracking import MlflowClient

PARAMS_PER_BATCH = 100  # MLflow's limit on params in one log_batch
METRICS_PER_BATCH = 1000  # and on metrics


def flat_params(config: dict[str, Any], prefix: str = "") -> list[Param]:
    """The config as params, nested keys joined by ``/``, values as text."""
    out: list[Param] = []
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out += flat_params(value, f"{prefix}{key}/")
        else:
            out.append(Param(f"{prefix}{key}", str(value)))
    return out


class MlflowTracker:
    keeps_files = True

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]) -> None:
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        local = not uri
        if local:
            uri = f"sqlite:///{(run_dir / 'mlflow.db').absolute()}"
        self.client = MlflowClient(uri)
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "rlhfless"
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(
            experiment, artifact_location=(run_dir / "mlflow-artifacts").absolute().as_uri()
            if local else None)
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        params = flat_params(config)
        for i in range(0, len(params), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + PARAMS_PER_BATCH])

    def log(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        batch = [Metric(key, value, now, step) for key, value in metrics.items()]
        for i in range(0, len(batch), METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i:i + METRICS_PER_BATCH])

    def finish(self, artifacts: Path | None, failed: bool) -> None:
        if artifacts is not None:
            self.client.log_artifacts(self.run_id, str(artifacts), artifacts.name)
        status = RunStatus.FAILED if failed else RunStatus.FINISHED
        self.client.set_terminated(self.run_id, RunStatus.to_string(status))


def open_tracker(config: dict[str, Any], run_dir: Path, name: str,
                 log: Callable[[str], None]) -> MlflowTracker:
    return MlflowTracker(run_dir, name, config)
