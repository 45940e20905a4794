"""Weights & Biases: a run named as ours, in project ``$WANDB_PROJECT`` (default
``rlhfless``), its files under ``<run>/wandb`` (the ``wandb`` extra).

W&B's own settings apply: ``WANDB_MODE=offline`` keeps everything in that folder, to upload
later with ``wandb sync``; online, W&B needs a login (``WANDB_API_KEY``). Metrics are plotted
against ``iteration``, a metric of each row, so a step logged again after a rollback or a
resume is kept (W&B drops a ``step=`` lower than the last one). The config is the run's
config; the report folder is saved as the run's files (``report/...``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import wandb


class WandbTracker:
    keeps_files = True

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]) -> None:
        self.run_dir = run_dir
        self.run = wandb.init(dir=str(run_dir), project=os.environ.get("WANDB_PROJECT")
                              or "rlhfless", name=name, config=config, reinit="create_new",
                              settings=wandb.Settings(console="off", silent=True))
        self.run.define_metric("iteration")
        self.run.define_metric("*", step_metric="iteration")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({**metrics, "iteration": step})

    def finish(self, artifacts: Path | None, failed: bool) -> None:
        if artifacts is not None:
            self.run.save(str(artifacts / "*"), base_path=str(self.run_dir), policy="now")
        self.run.finish(exit_code=1 if failed else 0)


def open_tracker(config: dict[str, Any], run_dir: Path, name: str,
                 log: Callable[[str], None]) -> WandbTracker:
    return WandbTracker(run_dir, name, config)
