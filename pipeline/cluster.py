"""Pools of workers inside one Dask ``SpecCluster``.

Dask has one worker type; an RL iteration needs several: generation workers (resource
``GEN=1``) and a trainer (``TRAIN=1``), each with its own threads. A ``Pool`` is a worker
template; ``PoolCluster`` keeps one entry per worker in the cluster's ``worker_spec`` named
``<pool>-<i>``, so one scheduler serves every pool and a pool is resized by editing its
entries. Which SpecCluster, and what one worker's entry is, comes from a ``Deployment``
(``deploy.py``): a ``LocalCluster`` of worker processes on this machine, or a dask-jobqueue
``SLURMCluster`` / ``PBSCluster`` whose entries are batch jobs with per-pool directives; the
growing, retiring and billing below are the same for both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from distributed import Client

from rlhfless.schedulers.dask_plugin import ElasticityPlugin, drain_events, retirable
from rlhfless.schedulers.ledger import CostLedger

from .config import Config
from .deploy import Deployment, LocalDeployment


@dataclass(frozen=True)
class Pool:
    name: str
    size: int
    threads: int  # Dask threads per worker = torch threads of its engine
    resources: dict[str, float] = field(default_factory=dict)
    memory: str = "4GiB"
    gpus: int = 0  # GPUs per worker: a batch job asks for them (--gres=gpu:N / ngpus=N)
    directives: tuple[str, ...] = ()  # extra batch-job directives of this pool


def pools_from_config(cfg: Config, elastic: bool = False) -> list[Pool]:
    """The generation pool and the trainer (``train_workers`` ranks); an elastic generation
    pool starts with one worker and grows as the policy decides."""
    return [
        Pool("gen", 1 if elastic else cfg.gen_workers, cfg.gen_threads, {"GEN": 1},
             cfg.worker_memory, cfg.gen_gpus, tuple(cfg.gen_job_directives)),
        Pool("train", cfg.train_workers, cfg.train_threads, {"TRAIN": 1}, cfg.worker_memory,
             cfg.train_gpus, tuple(cfg.train_job_directives)),
    ]


def pool_of(worker_name: str) -> str:
    return worker_name.rsplit("-", 1)[0]


class PoolCluster:
    """A SpecCluster whose workers are the members of named pools.

    Every start and stop goes to the ``CostLedger``: billing starts when a worker is
    requested (process start and model load are part of its cold start) and ends when the
    scheduler sees it leave. ``ElasticityPlugin`` reports arrivals, departures and task spans.
    """

    def __init__(self, pools: list[Pool], ledger: CostLedger, host: str = "127.0.0.1",
                 dashboard_address: str = "127.0.0.1:0",
                 deployment: Deployment | None = None) -> None:
        self.pools = {p.name: p for p in pools}
        self.ledger = ledger
        self.task_events: list[tuple] = []
        self._next_index = dict.fromkeys(self.pools, 0)
        self.deployment = deployment or LocalDeployment(host, dashboard_address)
        self.cluster = self.deployment.make_cluster([ElasticityPlugin()])
        self.client = Client(self.cluster)
        try:
            names = [n for pool in pools for n in self.grow(pool.name, pool.size, wait=False)]
            self.wait_for(names)
        except BaseException:
            self.close()
            raise

    def worker_names(self, pool: str) -> list[str]:
        return sorted((n for n in self.cluster.worker_spec if pool_of(n) == pool),
                      key=lambda n: int(n.rsplit("-", 1)[1]))

    def connected(self) -> set[str]:
        """Names of the workers connected to the scheduler now."""
        return {str(w["name"]) for w in
                self.client.scheduler_info(n_workers=-1)["workers"].values()}

    def address_of(self, name: str) -> str:
        for address, info in self.client.scheduler_info(n_workers=-1)["workers"].items():
            if str(info["name"]) == name:
                return address
        raise KeyError(f"worker {name!r} is not connected")

    def grow(self, pool: str, n: int, wait: bool = True) -> list[str]:
        """Start ``n`` more workers of ``pool``; returns their names.

        A name is never reused: SpecCluster closes a lost worker by name after a delay, which
        would stop a new worker of the same name that has not connected yet (a queued job)."""
        spec, names = self.pools[pool], []
        for _ in range(n):
            name = f"{pool}-{self._next_index[pool]}"
            self._next_index[pool] += 1
            self.cluster.worker_spec[name] = self.deployment.worker_spec(spec, name)
            self.ledger.worker_started(name, pool, time.time())
            names.append(name)
        # SpecCluster.scale applies worker_spec edits the same way
        self.cluster.sync(self.cluster._correct_state)
        if wait and names:
            self.wait_for(names)
        return names

    def wait_for(self, names: list[str]) -> None:
        """Block until every worker in ``names`` is connected (by name, so that a retired
        worker still on its way out is not counted), then take in the events."""
        timeout = self.deployment.start_timeout_s
        deadline = None if timeout is None else time.time() + timeout
        while True:
            connected = self.connected()
            missing = [n for n in names if n not in connected]
            if not missing:
                break
            if deadline is not None and time.time() > deadline:
                raise TimeoutError(
                    f"workers {missing} did not connect within {timeout:g} s; "
                    f"{self.deployment.describe(self.cluster, missing)}")
            time.sleep(0.1)
        self.sync_events()

    def retire(self, names: list[str]) -> list[str]:
        """Retire those of ``names`` that no scheduler plugin vetoes (a worker running a task
        or holding state a waiting task needs stays); their results move to other workers
        first. Returns the names retired."""
        self.sync_events()  # arrivals first, so that the ledger knows every worker
        allowed = self.client.run_on_scheduler(retirable, names=list(names))
        if allowed:
            # graceful: results the worker holds move to others; its nanny then stops it
            self.client.retire_workers(names=allowed, close_workers=False, remove=False)
            for name in allowed:
                self.cluster.worker_spec.pop(name, None)
            self.cluster.sync(self.cluster._correct_state)  # local: the processes exited
            self._wait_gone(allowed)  # batch jobs: cancelled, and their workers gone
            stopped = time.time()
            for name in allowed:
                if name in self.ledger.running():
                    self.ledger.worker_stopped(name, stopped)
        self.sync_events()
        return allowed

    def _wait_gone(self, names: list[str], timeout: float = 60.0) -> None:
        deadline = time.time() + timeout
        while still := self.connected() & set(names):
            if time.time() > deadline:
                raise TimeoutError(f"retired workers {sorted(still)} still connected "
                                   f"after {timeout:g} s")
            time.sleep(0.1)

    def sync_events(self) -> None:
        """Move the scheduler plugin's events into the ledger and ``task_events``. A worker
        that leaves without being retired (it crashed, or the batch system ended it) stops
        billing when the scheduler saw it go; a batch job that ended leaves its pool (the
        policy grows the pool again if it needs to), a crashed local worker is restarted by
        its nanny."""
        ended = []
        for kind, t, name, details in self.client.run_on_scheduler(drain_events):
            if kind == "arrive":
                if name not in self.ledger.running():  # restarted by its nanny after a crash
                    self.ledger.worker_started(name, pool_of(name), t)
                self.ledger.worker_ready(name, t)
            elif kind == "depart" and name in self.ledger.running():
                self.ledger.worker_stopped(name, t)
                if not self.deployment.restarts_workers and name in self.cluster.worker_spec:
                    ended.append(name)
            elif kind == "task":
                self.task_events.append((name, details))
        if ended:
            for name in ended:
                self.cluster.worker_spec.pop(name)
            self.cluster.sync(self.cluster._correct_state)

    @property
    def dashboard_link(self) -> str:
        return self.cluster.dashboard_link

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

