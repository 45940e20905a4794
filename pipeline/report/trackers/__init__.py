"""Experiment trackers: every metrics record of a run also goes to those ``report_to`` names.

``report_to`` lists any of ``tensorboard``, ``wandb``, ``mlflow``, ``trackio`` (the names TRL
uses); ``auto``, the default, is TensorBoard when the ``tensorboard`` package is installed and
nothing otherwise; ``[]`` is none. ``tracked(cfg, run, draw_graph, log)`` wraps a whole run:

* at the start it opens each tracker (one module each, beside this one, imported only when
  named), which logs the resolved config;
* every record appended to ``metrics.jsonl`` meanwhile goes to each, flattened (``scalars``):
  key ``<event>/<key>`` (``iteration/reward_mean``, ``eval/heldout_accuracy``; a nested table's
  keys joined by ``/`` below it), step = the record's iteration, only finite numbers;
* at a normal end, where a tracker keeps files, the run's report (``report/index.html`` and its
  figures, as ``rlhfless report`` writes them) and the iteration graph (``report/graph.png``)
  go to it as artifacts; then each tracker is finished (marked failed if the run raised).

``metrics.jsonl`` stays the record of the run: a tracker that fails to open, log or finish is
said in one line and gets nothing more from this run, which goes on and keeps every file.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .names import tracker_names

if TYPE_CHECKING:
    from ...config import Config
    from ...durable.runs import RunDir

NOT_SCALARS = {"iteration", "time"}  # the step, and the wall clock of the record


class Tracker(Protocol):
    """One tracker of one run. Its module's ``open_tracker(config, run_dir, name, log)`` makes
    it at the start of the run, with the resolved config already logged; ``log`` is called once
    per metrics record, in the order appended; ``finish`` once, at the end."""

    keeps_files: bool  # whether it stores artifacts (then the report is written for it)

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def finish(self, artifacts: Path | None, failed: bool) -> None:
        """``artifacts``: the folder of the report and graph, or None (none written, or the
        run failed); ``failed``: the run ended by an exception."""


def scalars(record: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """The step (the record's iteration; 0 for the records before the first) and the finite
    numbers of ``record``, keyed ``<event>/<key>[/<nested key>...]``."""
    out: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}/{key}", inner)
        elif (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value)):
            out[prefix] = float(value)

    event = record.get("event", "metrics")
    for key, value in record.items():
        if key not in NOT_SCALARS:
            walk(f"{event}/{key}", value)
    return int(record.get("iteration", 0)), out


def flat_config(cfg: Config) -> dict[str, Any]:
    """The resolved config as plain JSON values (what ``config.json`` holds)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


class Trackers:
    """The open trackers of a run as one metrics listener; each call is guarded, so that a
    tracker that raises is said once and dropped, and the run goes on."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.live: dict[str, Tracker] = {}
        self.say = log

    def guarded(self, name: str, what: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as err:  # a tracker's own failure: the run and its files go on
            self.live.pop(name, None)
            text = " ".join(str(err).split())[:300]
            self.say(f"report_to: {name} failed to {what} ({type(err).__name__}: {text}); it "
                     "gets nothing more from this run, metrics.jsonl has every record")
            return None

    def open(self, names: list[str], cfg: Config, run_dir: Path) -> None:
        config = flat_config(cfg)
        for name in names:
            tracker = self.guarded(name, "start", lambda n=name: importlib.import_module(
                f"{__name__}.{n}").open_tracker(config, run_dir, cfg.name, self.say))
            if tracker is not None:
                self.live[name] = tracker

    def __call__(self, record: dict) -> None:
        step, metrics = scalars(record)
        if not metrics:
            return
        for name, tracker in list(self.live.items()):
            self.guarded(name, "log", lambda t=tracker: t.log(metrics, step))

    def finish(self, artifacts: Path | None, failed: bool) -> None:
        for name, tracker in list(self.live.items()):
            self.guarded(name, "finish", lambda t=tracker: t.finish(artifacts, failed))
        self.live.clear()


def write_artifacts(run: RunDir, draw_graph: Callable[[str], object],
                    log: Callable[[str], None]) -> Path | None:
    """The run's report and its iteration graph (``draw_graph(filename)``) in
    ``<run>/report``; None where neither could be written (each failure said in one line)."""
    from ..page import write_report

    folder, wrote = run.path / "report", False
    for what, write in (("report", lambda: write_report(run.path, folder)),
                        ("graph", lambda: draw_graph(str(folder / "graph.png")))):
        try:
            write()
            wrote = True
        except Exception as err:  # matplotlib or graphviz missing: the metrics still went
            log(f"report_to: the run's {what} was not written for the trackers "
                f"({type(err).__name__}: {' '.join(str(err).split())[:200]})")
    return folder if wrote else None


@contextmanager
def tracked(cfg: Config, run: RunDir, draw_graph: Callable[[str], object],
            log: Callable[[str], None]) -> Iterator[Trackers]:
    """Open the trackers of ``cfg.report_to``, feed them the run's metrics records while the
    block runs, then hand them its artifacts (on a normal end: the report, and the iteration
    graph ``draw_graph(filename)`` draws) and finish them."""
    trackers = Trackers(log)
    trackers.open(tracker_names(cfg.report_to), cfg, run.path)
    run.listeners.append(trackers)
    failed = True
    try:
        yield trackers
        failed = False
    finally:
        run.listeners.remove(trackers)
        keeping = any(t.keeps_files for t in trackers.live.values())
        artifacts = write_artifacts(run, draw_graph, log) if keeping and not failed else None
        trackers.finish(artifacts, failed)
