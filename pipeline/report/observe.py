"""Watching a run while it runs: the dashboard link, metric listeners, TensorBoard.

``observed(run, dashboard_link, on_metrics)`` wraps the training loop:

* at enter it writes ``dashboard.json`` (the Dask dashboard link, this host and process, the
  start time) and at exit adds the end time, so ``rlhfless report`` links the dashboard only
  while the run is live (``dashboard_status``);
* every record appended to ``metrics.jsonl`` meanwhile also goes to ``on_metrics`` (a
  notebook's live plot) and, when the ``tensorboard`` package is installed, to TensorBoard
  scalars under ``<run>/tb``: tag ``<event>/<key>`` (``iteration/reward_mean``,
  ``eval/heldout_accuracy``), step = the record's iteration. Without tensorboard nothing is
  written and nothing is said.

The dashboard is off unless ``dashboard = true`` (plain HTTP with no authentication: any user
of the host may read it), and then the run says where it listens. ``install_sitemap`` mends
distributed's ``/sitemap.json``, which raised on the dashboard's static routes and printed a
traceback into the run's output at any local user's request.
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import distributed.http.routing
from tornado.routing import PathMatches, RuleRouter

from ..durable.runs import RunDir

SKIP_SCALARS = {"iteration", "time", "policy_version", "t"}


class TensorBoardListener:
    """Numeric fields of each metrics record as TensorBoard scalars (``SummaryWriter``)."""

    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def __call__(self, record: dict) -> None:
        event = record.get("event", "metrics")
        step = int(record.get("iteration", 0))
        for key, value in record.items():
            if (key in SKIP_SCALARS or isinstance(value, bool)
                    or not isinstance(value, (int, float)) or not math.isfinite(value)):
                continue
            self.writer.add_scalar(f"{event}/{key}", value, global_step=step,
                                   walltime=record.get("time"))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def tensorboard_listener(run: RunDir) -> TensorBoardListener | None:
    """A listener writing under ``<run>/tb``, or None when tensorboard is not installed."""
    try:
        return TensorBoardListener(run.path / "tb")
    except ImportError:
        return None


def _paths(router: RuleRouter, seen: set, out: set[str]) -> None:
    """The path patterns of ``router``'s rules and of the routers below it."""
    if router in seen:
        return
    seen.add(router)
    for rule in [*router.named_rules.values(), *router.rules]:
        if isinstance(rule.matcher, PathMatches):
            out.add(rule.matcher.regex.pattern.rstrip("$"))
        if isinstance(rule.target, RuleRouter):
            _paths(rule.target, seen, out)


class Sitemap(distributed.http.routing.DirectoryHandler):
    """``/sitemap.json``: every route's path pattern (distributed's own listed the files
    behind static routes and raised on those that name none, as the dashboard's do)."""

    def get(self) -> None:
        out: set[str] = set()
        seen: set = set()
        for app in [*self.application.applications, self.application]:
            if hasattr(app, "app_paths"):  # bokeh's application
                out.update(app.app_paths)
            else:
                _paths(app.default_router, seen, out)
                _paths(app.wildcard_router, seen, out)
        self.write({"paths": sorted(out)})


def install_sitemap() -> None:
    """Serve ``Sitemap`` from every HTTP server this process starts from now on."""
    distributed.http.routing.DirectoryHandler = Sitemap


@contextmanager
def observed(run: RunDir, dashboard_link: str,
             on_metrics: Callable[[dict], None] | None = None) -> Iterator[RunDir]:
    """Record the dashboard link and attach the listeners for the duration of a run."""
    run.write_json("dashboard.json", {"link": dashboard_link, "host": socket.gethostname(),
                                      "pid": os.getpid(), "started": time.time()})
    tb = tensorboard_listener(run)
    added = [x for x in (on_metrics, tb) if x is not None]
    run.listeners.extend(added)
    try:
        yield run
    finally:
        for listener in added:
            run.listeners.remove(listener)
        if tb is not None:
            tb.close()
        run.write_json("dashboard.json", run.read_json("dashboard.json") | {"ended": time.time()})


def dashboard_status(run: RunDir) -> dict | None:
    """``dashboard.json`` plus ``live``: the run has not ended and, on this host, its process
    is alive (a run killed before it could write its end time is not live). None if absent."""
    path = run.path / "dashboard.json"
    if not path.exists():
        return None
    info = run.read_json("dashboard.json")
    live = "ended" not in info
    if live and info.get("host") == socket.gethostname():
        try:
            os.kill(int(info["pid"]), 0)
        except ProcessLookupError:
            live = False
        except PermissionError:  # alive, owned by someone else
            pass
    return info | {"live": live}
