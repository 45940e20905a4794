"""trackio: a run named as ours in project ``rlhfless`` of a local trackio directory (the
``trackio`` extra); ``TRACKIO_DIR=runs/<name>/trackio trackio show --project rlhfless`` shows
it.

trackio reads its directory from ``TRACKIO_DIR`` once, when first imported: unless that is set,
the first run of a process that names trackio imports it with ``<run>/trackio``, and a later
run of the same process writes where the first did (said in one line). The config is the run's
config; the report folder is the artifact ``report`` (type ``report``). A resumed run goes on
in the same trackio run."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROJECT = "rlhfless"


def import_trackio(home: Path):
    """trackio, imported with ``TRACKIO_DIR = home`` unless it is set or already imported."""
    if "trackio" in sys.modules or os.environ.get("TRACKIO_DIR"):
        import trackio
        return trackio
    os.environ["TRACKIO_DIR"] = str(home)
    try:
        import trackio
    finally:
        del os.environ["TRACKIO_DIR"]
    return trackio


class TrackioTracker:
    keeps_files = True

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any],
                 log: Callable[[str], None]) -> None:
        trackio = import_trackio(run_dir / "trackio")
        where = Path(trackio.utils.TRACKIO_DIR)
        if where != run_dir / "trackio":
            log(f"report_to: trackio writes to {where} (TRACKIO_DIR, read once per process)")
        self.run = trackio.init(project=PROJECT, name=name, config=config, resume="allow",
                                embed=False, auto_log_gpu=False, auto_log_cpu=False)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self, artifacts: Path | None, failed: bool) -> None:
        if artifacts is not None:
            self.run.log_artifact(str(artifacts), name=artifacts.name, type="report")
        self.run.finish()


def open_tracker(config: dict[str, Any], run_dir: Path, name: str,
                 log: Callable[[str], None]) -> TrackioTracker:
    return TrackioTracker(run_dir, name, config, log)
