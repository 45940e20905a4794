"""TensorBoard: scalars under ``<run>/tb`` (torch's ``SummaryWriter``; the ``tensorboard``
extra). The config is a text summary, ``config``, at step 0; TensorBoard keeps no artifacts."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter


class TensorBoardTracker:
    keeps_files = False

    def __init__(self, log_dir: Path, config: dict[str, Any]) -> None:
        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.writer.add_text("config", f"```\n{json.dumps(config, indent=1)}\n```", 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def finish(self, artifacts: Path | None, failed: bool) -> None:
        self.writer.close()


def open_tracker(config: dict[str, Any], run_dir: Path, name: str,
                 log: Callable[[str], None]) -> TensorBoardTracker:
    return TensorBoardTracker(run_dir / "tb", config)
