"""Watching a run while it runs: the dashboard link and the metric listener of a notebook.

``observed(run, dashboard_link, on_metrics)`` wraps the training loop:

* at enter it writes ``dashboard.json`` (the Dask dashboard link, this host and process, the
  start time) and at exit adds the end time, so ``rlhfless report`` links the dashboard only
  while the run is live (``dashboard_status``);
* every record appended to ``metrics.jsonl`` meanwhile also goes to ``on_metrics`` (a
  notebook's live plot). The trackers (TensorBoard, W&B, MLflow, trackio) are ``trackers/``.

The dashboard is off unless ``dashboard = true`` (plain HTTP with no authentication: any user
of the host may read it), and then the run says where it listens (its ``/sitemap.json``:
``cluster/sitemap.py``).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..durable.runs import RunDir


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
