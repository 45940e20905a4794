"""Pools of workers inside one Dask ``SpecCluster``, the generation pool scaled adaptively.

Dask has one worker type; an RL iteration needs several: generation workers (resource
``GEN=1``) and a trainer (``TRAIN=1``), each with its own threads. A ``Pool`` is a worker
template (``deploy.py``); the cluster, made by a ``Deployment`` (a ``LocalCluster`` of
worker processes on this machine, or a dask-jobqueue ``SLURMCluster`` / ``PBSCluster`` whose
workers are batch jobs), names its workers ``<pool>-<i>`` and grows a pool through
SpecCluster's own ``scale`` (``deploy.PoolScaling``).

The generation pool scales through Dask's adaptive machinery: ``PoolAdaptive``
(``schedulers/dask/adaptive.py``), installed with ``cluster.adapt``, reads its target from the
scheduler's ``ElasticityPlugin``; ``scale`` sets that target (the elastic policy's count)
and runs one adaptive step at once instead of waiting for the next periodic one. Between
the driver's decisions the target follows the queued generation work (once the driver has
installed the policy's sizing rule, ``install_sizing``), and the periodic steps apply it;
``sync_events`` bills the workers they start from their request. Retiring honours the
plugin's veto. The fixed pools (the trainer) grow by ``scale_pool``.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

import dask
from dask.utils import parse_timedelta
from distributed import Client
from distributed.core import Status

from rlhfless.ops.engine.registry import engine_class
from rlhfless.schedulers.dask.adaptive import PoolAdaptive
from rlhfless.schedulers.dask.plugin import ElasticityPlugin, drain_events, pool_of, set_pool_target
from rlhfless.schedulers.ledger import CostLedger
from rlhfless.schedulers.pool_split import PoolSplit, split_for_overlap

from ..config import Config
from .deploy import Deployment, LocalDeployment, Pool
from .supervise import dask_bounds, dask_environment

# the task modules each pool's workers import as they start, before any task: every module
# whose tasks they run, so that no task's unpickling imports a framework while a task thread
# imports it too (a tail's move, unpickled as the engine loaded, found transformers half
# imported: "cannot import name 'DynamicCache'"); the tail tasks where the engine exports
# its KV cache (``tail.py`` imports no framework: an emulated worker loads it too)
GEN_TASKS = ("rlhfless.pipeline.tasks.rollout",)
TAIL_TASKS = ("rlhfless.pipeline.tasks.tail",)
TRAIN_TASKS = ("rlhfless.pipeline.tasks.trainer",)
ADAPT_INTERVAL_S = 1.0  # Adaptive's periodic check; scale() does not wait for it


def gen_tasks(backend: str) -> tuple[str, ...]:
    """The task modules a generation worker of ``backend``'s engine imports as it starts."""
    return GEN_TASKS + (TAIL_TASKS if engine_class(backend).exports_kv else ())


def pools_from_config(cfg: Config, elastic: bool = False) -> list[Pool]:
    """The generation pool and the trainer (``train_workers`` ranks); an elastic generation
    pool starts with one worker and grows as the policy decides. Each pool's worker imports
    its task modules as it starts (``Pool.preload``) and reads the run's Dask bounds from its
    environment (``Pool.env``)."""
    env = dask_environment(dask_bounds(cfg.worker_ttl_s, cfg.connect_timeout_s))
    return [
        Pool("gen", 1 if elastic else cfg.gen_workers, cfg.gen_threads, {"GEN": 1},
             cfg.worker_memory, cfg.gen_gpus, tuple(cfg.gen_job_directives),
             preload=gen_tasks(cfg.backend), env=env),
        Pool("train", cfg.train_workers, cfg.train_threads, {"TRAIN": 1}, cfg.worker_memory,
             cfg.train_gpus, tuple(cfg.train_job_directives), preload=TRAIN_TASKS, env=env),
    ]


def fit_overlap(cfg: Config) -> tuple[Config, PoolSplit | None]:
    """An async mode whose pools share this machine's cores (a local cluster on the CPU) runs
    the generation workers and trainer threads that fit them (``schedulers/pool_split.py``),
    unless ``overlap_pools = "as_set"``; every other run is left as configured (batch jobs
    have cores of their own, a GPU generates on the GPU, an engine that does not compute,
    the emulated one, sleeps)."""
    if (not cfg.mode.startswith("async") or cfg.cluster != "local"
            or cfg.overlap_pools != "fit_cores" or not _on_cpu(cfg.device)
            or not engine_class(cfg.backend).computes):
        return cfg, None
    split = split_for_overlap(_cores(), cfg.gen_threads, cfg.gen_workers, cfg.train_threads,
                              cfg.train_workers)
    return replace(cfg, gen_workers=split.gen_workers, train_threads=split.train_threads), split


def _cores() -> int:
    """Cores this process may run on (its affinity, as a batch system or taskset sets it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _on_cpu(device: str) -> bool:
    if device != "auto":
        return device == "cpu"
    import torch
    return not torch.cuda.is_available()


class PoolCluster:
    """A SpecCluster whose workers are the members of named pools.

    Every start and stop goes to the ``CostLedger``: billing starts when a worker is
    requested (process start and model load are part of its cold start) and ends when its
    process has exited (or the scheduler saw it leave). ``ElasticityPlugin`` reports
    arrivals and departures.
    """

    def __init__(self, pools: list[Pool], ledger: CostLedger, host: str = "127.0.0.1",
                 dashboard_address: str = "127.0.0.1:0",
                 deployment: Deployment | None = None, adaptive_pool: str = "gen") -> None:
        self.pools = {p.name: p for p in pools}
        self.ledger = ledger
        self.deployment = deployment or LocalDeployment(host, dashboard_address)
        self.cluster = self.deployment.make_cluster([ElasticityPlugin()])
        if not self.deployment.restarts_workers:  # a lost trainer is replaced at once
            self.cluster.replaced_pools = frozenset(p.name for p in pools
                                                    if p.name != adaptive_pool)
        self.cluster.set_pools({p.name: (lambda name, p=p: self.deployment.worker_spec(p, name))
                                for p in pools})
        self.client = Client(self.cluster)
        self.adaptive_pool = adaptive_pool
        self.left: dict[str, float] = {}  # name -> when it left unasked, not back yet
        self.adaptive = self.cluster.adapt(Adaptive=PoolAdaptive, pool=adaptive_pool,
                                           interval=ADAPT_INTERVAL_S, wait_count=1)
        try:
            self.wait_for(self.start({p.name: p.size for p in pools}))
        except BaseException:
            self.close()
            raise

    def worker_names(self, pool: str) -> list[str]:
        return self.cluster.pool_members(pool)

    def connected(self) -> set[str]:
        """Names of the workers connected to the scheduler now."""
        return {str(w["name"]) for w in
                self.client.scheduler_info(n_workers=-1)["workers"].values()}

    def address_of(self, name: str) -> str:
        """The address of worker ``name``. A worker of the cluster's plan that is not
        connected at this moment (starting, or restarting under its nanny) is waited for
        (``wait_for``); KeyError for a worker that left the plan, or left unasked from a
        deployment that does not restart workers and is not back (``sync_events``)."""
        for waited in (False, True):
            for address, info in self.client.scheduler_info(n_workers=-1)["workers"].items():
                if str(info["name"]) == name:
                    return address
            if waited or name not in self.cluster.worker_spec or name in self.left:
                break
            self.wait_for([name])
        raise KeyError(f"worker {name!r} is not connected")

    def scale(self, pool: str, n: int, close: list[str] = ()) -> list[str]:
        """Set the adaptive pool's target to ``n`` (``close``: which workers to close first)
        and apply it now; returns the pool's workers after. A worker the plugin vetoes stays,
        and the target follows what the pool became, so that no later adaptive step closes
        a worker the caller goes on to use."""
        if pool != self.adaptive_pool:
            raise ValueError(f"scale({pool!r}): only pool {self.adaptive_pool!r} is adaptive")
        self.sync_events()  # arrivals first, so that the ledger knows every worker
        before, requested = set(self.worker_names(pool)), time.time()
        self.client.run_on_scheduler(set_pool_target, pool=pool, n=n, close=list(close))
        for _ in range(3):  # a vetoed worker may be free a moment later
            self.cluster.sync(self.adaptive.adapt)
            if len(self.worker_names(pool)) == n:
                break
            time.sleep(0.05)
        after = self.worker_names(pool)
        self.client.run_on_scheduler(set_pool_target, pool=pool, n=len(after))
        added = sorted(set(after) - before, key=after.index)
        for name in added:
            self.ledger.worker_started(name, pool,
                                       self.adaptive.requested_at.pop(name, requested))
        gone = sorted(before - set(after))
        self._wait_gone(gone)  # batch jobs: cancelled, and their workers gone
        stopped = time.time()
        for name in gone:
            if name in self.ledger.running():
                self.ledger.worker_stopped(name, stopped)
        self.wait_for(added)
        return after

    def grow(self, pool: str, n: int, wait: bool = True) -> list[str]:
        """Start ``n`` more workers of ``pool``; returns their names."""
        if pool == self.adaptive_pool and wait:
            before = self.worker_names(pool)
            return [w for w in self.scale(pool, len(before) + n) if w not in before]
        names = self.start({pool: len(self.worker_names(pool)) + n})
        if wait and names:
            self.wait_for(names)
        return names

    def start(self, sizes: dict[str, int]) -> list[str]:
        """Request workers so that each pool of ``sizes`` has its count, all at once (their
        processes start together), billed from now; returns their names, not waited for."""
        names = self.cluster.scale_pools(sizes)
        requested = time.time()
        for name in names:
            self.ledger.worker_started(name, pool_of(name), requested)
        if self.adaptive_pool in sizes:
            self.client.run_on_scheduler(set_pool_target, pool=self.adaptive_pool,
                                         n=len(self.worker_names(self.adaptive_pool)))
        return names

    def wait_for(self, names: list[str]) -> None:
        """Block until every worker in ``names`` is connected (by name, so that a retired
        worker still on its way out is not counted) and its process handle has finished
        starting, then take in the events. A local worker registers with the scheduler a
        moment before its nanny's start returns; a worker killed in that moment failed its
        nanny's start, and SpecCluster then closed the nanny, so the worker never came back."""
        timeout = self.deployment.start_timeout_s
        deadline = None if timeout is None else time.time() + timeout
        while True:
            connected = self.connected()
            handles = self.cluster.workers  # SpecCluster adds a handle once it started
            missing = [n for n in names if n not in connected
                       or getattr(handles.get(n), "status", None) != Status.running]
            if not missing:
                break
            if deadline is not None and time.time() > deadline:
                raise TimeoutError(
                    f"workers {missing} did not connect within {timeout:g} s; "
                    f"{self.deployment.describe(self.cluster, missing)}")
            time.sleep(0.1)
        self.sync_events()

    def retire(self, names: list[str]) -> list[str]:
        """Retire those of ``names`` (of the adaptive pool) that no scheduler plugin vetoes (a
        worker running a task or holding state a waiting task needs stays); their results
        move to other workers first. Returns the names retired."""
        members = self.worker_names(self.adaptive_pool)
        asked = [n for n in names if n in members]
        if not asked:
            return []
        after = self.scale(self.adaptive_pool, len(members) - len(asked), close=asked)
        return [n for n in asked if n not in after]

    def _wait_gone(self, names: list[str], timeout: float = 60.0) -> None:
        deadline = time.time() + timeout
        while still := self.connected() & set(names):
            if time.time() > deadline:
                raise TimeoutError(f"retired workers {sorted(still)} still connected "
                                   f"after {timeout:g} s")
            time.sleep(0.1)

    def sync_events(self) -> None:
        """Move the scheduler plugin's events into the ledger. A worker the periodic
        adaptive step started (the queue raised the target) is billed from its request; a
        worker that leaves without being retired (it crashed, or the batch system ended it)
        stops billing when the scheduler saw it go; a crashed local worker is restarted by
        its nanny at once, a new lifetime billed from then (its cold start included, even if
        the run ends before it is back). Where workers do not come back by themselves (batch
        jobs), one that left unasked leaves its pool once it has not come back within Dask's
        ``distributed.deploy.lost-worker-timeout`` (the policy grows the pool again if it
        needs to): a nanny on a host that still answers restarts its worker (the stall watch
        restarts a stalled one so), and closing that worker as a job that ended left a run
        with no generation worker. A retired worker has left the cluster's plan before it
        departs: its departure ends its billing only."""
        for kind, t, name, _ in self.client.run_on_scheduler(drain_events):
            if kind == "arrive":
                self.left.pop(name, None)
                if name not in self.ledger.running():
                    requested = self.cluster.replaced_at.pop(name, None)  # a lost one's
                    self.ledger.worker_started(name, pool_of(name), requested or
                                               self.adaptive.requested_at.pop(name, t))
                self.ledger.worker_ready(name, t)
            elif kind == "depart" and name in self.ledger.running():
                self.ledger.worker_stopped(name, t)
                if name not in self.cluster.worker_spec:
                    continue
                if self.deployment.restarts_workers:
                    self.ledger.worker_started(name, pool_of(name), t)
                else:
                    self.left[name] = t
        grace = parse_timedelta(dask.config.get("distributed.deploy.lost-worker-timeout"))
        ended = [n for n, t in self.left.items() if time.time() - t > grace]
        for name in ended:
            del self.left[name]
        ended = [n for n in ended if n in self.cluster.worker_spec]
        if ended:
            self.cluster.sync(self.cluster.scale_down, ended)
            if any(pool_of(n) == self.adaptive_pool for n in ended):
                self.client.run_on_scheduler(set_pool_target, pool=self.adaptive_pool,
                                             n=len(self.worker_names(self.adaptive_pool)))

    @property
    def dashboard_link(self) -> str:
        """The dashboard's address; empty when the deployment serves none."""
        return self.cluster.dashboard_link if self.deployment.dashboard else ""

    def close(self) -> None:
        self.sync_events()
        self.client.close()
        self.cluster.close()
        now = time.time()
        for name in self.ledger.running():  # the scheduler is gone: stop billing now
            self.ledger.worker_stopped(name, now)

    def __enter__(self) -> PoolCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

