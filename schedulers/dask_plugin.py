"""The scheduler-side half of elasticity: each pool's target, the retirement veto, events.

``ElasticityPlugin`` runs inside the Dask scheduler. It holds the worker count the elastic
policy wants for each pool (``set_pool_target``, from the driver, where the policy has the
batch's predicted lengths) and answers the cluster's ``PoolAdaptive`` (``dask_adaptive.py``)
through two scheduler handlers it installs at start:

* ``elastic_target(pool)``: the pool's target, or None when none was set;
* ``elastic_workers_to_close(pool, n)``: up to ``n`` workers of the pool that may close now:
  the ones the policy named, else the idlest; every plugin's ``valid_workers_downscaling``
  filters them.

A ``SchedulerPlugin`` cannot start or stop workers; the cluster object does, through Dask's
own ``Adaptive`` machinery, which reads the target from here.

``valid_workers_downscaling`` is Dask's own hook for "may these workers be retired?", called
by ``Scheduler.workers_to_close`` (hence by ``Adaptive`` on any SpecCluster, dask-jobqueue's
included) and by ``elastic_workers_to_close``. A worker is kept while it runs a task or while
a waiting task is pinned to it (a continuation that resumes from the KV cache the worker
holds, or a task that needs its warm engine).

It also records, as plain tuples the driver drains (``drain``), worker arrivals and
departures (scheduler clock) with the worker's name and resources: the cost ledger's input.
"""

from __future__ import annotations

import time

from distributed.diagnostics.plugin import SchedulerPlugin

PLUGIN_NAME = "rlhfless-elasticity"


def pool_of(worker_name: str) -> str:
    """The pool of a worker named ``<pool>-<i>``."""
    return str(worker_name).rsplit("-", 1)[0]


class ElasticityPlugin(SchedulerPlugin):
    name = PLUGIN_NAME

    def __init__(self) -> None:
        self.events: list[tuple] = []  # (kind, t, worker name, details)
        self.targets: dict[str, int] = {}  # pool -> workers the policy wants
        self.to_close: dict[str, list[str]] = {}  # pool -> workers the policy would close
        self._names: dict[str, str] = {}  # address -> worker name
        self.scheduler = None

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers["elastic_target"] = self.target
        scheduler.handlers["elastic_workers_to_close"] = self.workers_to_close

    def add_worker(self, scheduler=None, worker: str | None = None) -> None:
        ws = scheduler.workers[worker]
        self._names[worker] = str(ws.name)
        self.events.append(("arrive", time.time(), str(ws.name), dict(ws.resources)))

    def remove_worker(self, scheduler=None, worker: str | None = None, *, stimulus_id=None,
                      **kwargs) -> None:
        name = self._names.pop(worker, worker)
        self.events.append(("depart", time.time(), name, {}))

    def drain(self) -> list[tuple]:
        events, self.events = self.events, []
        return events

    # ---- targets -----------------------------------------------------------------------

    def set_target(self, pool: str, n: int, close: list[str] = ()) -> None:
        """The policy wants ``n`` workers in ``pool``; ``close``: which to close first."""
        self.targets[pool] = int(n)
        self.to_close[pool] = [str(c) for c in close]

    def target(self, pool: str) -> int | None:
        return self.targets.get(pool)

    def workers_to_close(self, pool: str, n: int) -> list[str]:
        """Up to ``n`` names of ``pool``'s workers that may close now: those the policy named
        (and only those, when it named any), else idle ones holding the least data first;
        every plugin may veto (``valid_workers_downscaling``)."""
        scheduler = self.scheduler
        members = [ws for ws in scheduler.workers.values() if pool_of(ws.name) == pool]
        named = self.to_close.get(pool)
        if named:
            candidates = [ws for ws in members if str(ws.name) in named]
        else:
            candidates = sorted(members, key=lambda ws: (len(ws.processing), ws.nbytes))
        for plugin in scheduler.plugins.values():
            candidates = plugin.valid_workers_downscaling(scheduler, candidates)
        return [str(ws.name) for ws in candidates][: max(int(n), 0)]

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


def set_pool_target(dask_scheduler, pool: str, n: int, close: list[str] = ()) -> None:
    """For ``client.run_on_scheduler``: the policy's target of ``pool``."""
    dask_scheduler.plugins[PLUGIN_NAME].set_target(pool, n, close)
