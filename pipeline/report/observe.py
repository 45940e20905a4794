"""Watching a run while it runs: the dashboard link and the metric listener of a notebook.

``observed(run, dashboard_link, on_metrics)`` wraps the training loop:

* at enter it writes ``dashboard.json`` (the Dask dashboard link, this host and process, the
  start time) and at exit adds the end time, so ``rlhfless report`` links the dashboard only
  while the run is live (``dashboard_status``);
* every record appended to ``metrics.jsonl`` meanwhile also goes to ``on_metrics`` (a
  notebook's live plot). The trackers (TensorBoard, W&B, MLflow, trackio) are ``trackers/``.

The dashboard is off unless ``dashboard = true`` (plain HTTP with no authentication: any user
of the host may read it), and then the run says where it listens. ``install_sitemap`` mends
distributed's ``/sitemap.json``, which raised on the dashboard's static routes and printed a
traceback into the run's output at any local user's request.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import distributed.http.routing
from tornado.routing import PathMatches, RuleRouter

from ..durable.runs import RunDir


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
    """Record the dashboard link and attach ``on_metrics`` for the duration of a run."""
    run.write_json("dashboard.json", {"link": dashboard_link, "host": socket.gethostname(),
                                      "pid": os.getpid(), "started": time.time()})
    if on_metrics is not None:
        run.listeners.append(on_metrics)
    try:
        yield run
    finally:
        if on_metrics is not None:
            run.listeners.remove(on_metrics)
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
