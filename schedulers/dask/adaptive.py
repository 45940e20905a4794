"""Dask's own adaptive scaling, for one pool of a pooled cluster, to the policy's target.

``PoolAdaptive`` is a ``distributed.deploy.Adaptive`` (install it with
``cluster.adapt(Adaptive=PoolAdaptive, pool="gen", ...)``) whose

* ``plan`` / ``requested`` / ``observed`` are those of the cluster's workers of ``pool``
  (named ``<pool>-<i>``), so ``AdaptiveCore.recommendations`` reasons about that pool only;
* ``target`` is the count the elastic policy set in the scheduler (``ElasticityPlugin``'s
  ``elastic_target`` handler: the driver's, or the one the queued generation work asks
  for; none set: the pool stays as it is);
* ``workers_to_close`` asks the plugin (``elastic_workers_to_close``), which closes the
  workers the policy named, or the idlest, never one that a scheduler plugin vetoes;
* ``scale_up(n)`` grows the pool to ``n`` through the cluster's ``scale_pool`` (SpecCluster's
  ``scale`` with the pool's worker template); ``scale_down`` is Adaptive's, a graceful
  ``retire_workers`` on the scheduler (results move to other workers) then
  ``cluster.scale_down``, except that the scheduler keeps the worker until its process has
  left (``remove=False``), so that a last heartbeat is not that of an unknown worker.

A step may start on its own (the periodic callback, when the queued work moved the
target) or from the driver (``PoolCluster.scale``); ``adapt`` runs one step at a time, a
driver's waiting for one under way, so that the driver reads the pool once it has settled.
``requested_at`` keeps when each worker was asked for, so that the cost ledger bills a
worker the scheduler's queue started from its request, as it does the driver's.

The cluster is any SpecCluster with ``scale_pool(pool, n)``: ``deploy.PoolScaling`` mixed into
a ``LocalCluster`` or a dask-jobqueue ``SLURMCluster`` / ``PBSCluster``. Everything else
(the periodic callback, the ``wait_count`` damping, the log of decisions) is Dask's.
"""

from __future__ import annotations

import asyncio
import time
from inspect import isawaitable
from typing import Any

from distributed.deploy.adaptive import Adaptive

from .plugin import pool_of


class PoolAdaptive(Adaptive):
    """Adaptive scaling of ``pool`` to the target held by the scheduler plugin."""

    def __init__(self, cluster: Any = None, pool: str = "gen", **kwargs: Any) -> None:
        self.pool = pool
        self.requested_at: dict[str, float] = {}  # worker name -> when it was asked for
        self._step = asyncio.Lock()
        super().__init__(cluster, **kwargs)

    async def adapt(self) -> None:
        async with self._step:
            await super().adapt()

    def _mine(self, names: set) -> set:
        return {n for n in names if pool_of(n) == self.pool}

    @property
    def plan(self) -> set:
        return self._mine(self.cluster.plan)

    @property
    def requested(self) -> set:
        return self._mine(self.cluster.requested)

    @property
    def observed(self) -> set:
        return self._mine(self.cluster.observed)

    async def target(self) -> int:
        wanted = await self.scheduler.elastic_target(pool=self.pool)
        return len(self.plan) if wanted is None else int(wanted)

    async def workers_to_close(self, target: int) -> list[str]:
        return await self.scheduler.elastic_workers_to_close(
            pool=self.pool, n=len(self.plan) - target)

    async def scale_up(self, n: int) -> None:
        before, asked = self.plan, time.time()
        self.cluster.scale_pool(self.pool, n)
        self.requested_at |= dict.fromkeys(self.plan - before, asked)

    async def scale_down(self, workers: list[str]) -> None:
        if not workers:
            return
        await self.scheduler.retire_workers(names=workers, remove=False, close_workers=False)
        closing = self.cluster.scale_down(workers)
        if isawaitable(closing):
            await closing
