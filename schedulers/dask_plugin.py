"""The scheduler-side half of elasticity: observe, and veto retiring needed workers.

``ElasticityPlugin`` runs inside the Dask scheduler. It records, as plain tuples the driver
drains each iteration (``drain``):

* worker arrivals and departures (scheduler clock), with the worker's name and resources;
* the compute span and worker of every finished task.

It never starts or stops workers: a ``SchedulerPlugin`` cannot, and the decisions come from
the pure policies in this package, applied through the cluster object by the driver.

``valid_workers_downscaling`` is Dask's own hook for "may these workers be retired?", called
by ``Scheduler.workers_to_close`` (hence by ``Adaptive`` on any SpecCluster, dask-jobqueue's
included) and by our driver before it retires anyone. A worker is kept while it runs a task
or while a waiting task is pinned to it (a continuation that resumes from the KV cache the
worker holds, or a task that needs its warm engine).
"""

from __future__ import annotations

import time

from dask.utils import key_split
from distributed.diagnostics.plugin import SchedulerPlugin

PLUGIN_NAME = "rlhfless-elasticity"


class ElasticityPlugin(SchedulerPlugin):
    name = PLUGIN_NAME

    def __init__(self) -> None:
        self.events: list[tuple] = []  # (kind, t, worker name, details)
        self._names: dict[str, str] = {}  # address -> worker name

    def add_worker(self, scheduler=None, worker: str | None = None) -> None:
        ws = scheduler.workers[worker]
        self._names[worker] = str(ws.name)
        self.events.append(("arrive", time.time(), str(ws.name), dict(ws.resources)))

    def remove_worker(self, scheduler=None, worker: str | None = None, *, stimulus_id=None,
                      **kwargs) -> None:
        name = self._names.pop(worker, worker)
        self.events.append(("depart", time.time(), name, {}))

    def transition(self, key, start, finish, *args, stimulus_id=None, **kwargs) -> None:
        if start != "processing" or finish != "memory":
            return
        spans = [s for s in kwargs.get("startstops", ()) if s.get("action") == "compute"]
        worker = kwargs.get("worker")
        name = self._names.get(worker, worker)
        for span in spans:
            self.events.append(("task", span["stop"], name,
                                {"stage": key_split(key), "key": str(key),
                                 "start": span["start"], "stop": span["stop"]}))

    def drain(self) -> list[tuple]:
        events, self.events = self.events, []
        return events

    def valid_workers_downscaling(self, scheduler, workers: list) -> list:
        needed = set()
        for ws in workers:
            if ws.processing:
                needed.add(ws.address)
        for ts in scheduler.tasks.values():
            if ts.state in ("waiting", "no-worker", "queued") and ts.worker_restrictions:
                needed.update(ts.worker_restrictions)
        return [ws for ws in workers if ws.address not in needed]


def drain_events(dask_scheduler) -> list[tuple]:
    """For ``client.run_on_scheduler``: the plugin's events since the last drain."""
    return dask_scheduler.plugins[PLUGIN_NAME].drain()


def retirable(dask_scheduler, names: list[str]) -> list[str]:
    """For ``client.run_on_scheduler``: which of ``names`` every plugin lets retire now."""
    candidates = [ws for ws in dask_scheduler.workers.values() if str(ws.name) in names]
    for plugin in dask_scheduler.plugins.values():
        candidates = plugin.valid_workers_downscaling(dask_scheduler, candidates)
    return [str(ws.name) for ws in candidates]
