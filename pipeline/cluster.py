"""Pools of workers inside one Dask ``SpecCluster``.

Dask has one worker type; an RL iteration needs several: generation workers (resource
``GEN=1``) and a trainer (``TRAIN=1``), each with its own threads. A ``Pool`` is a worker
template; ``PoolCluster`` keeps one entry per worker in the cluster's ``worker_spec`` named
``<pool>-<i>``, so one scheduler serves every pool and a pool is resized by editing its
entries. ``LocalCluster`` (worker processes on this machine) is the SpecCluster used here;
dask-jobqueue clusters are SpecClusters too, which is how the same pools run as batch jobs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from distributed import Client, LocalCluster, Nanny

from rlhfless.schedulers.dask_plugin import ElasticityPlugin, drain_events, retirable
from rlhfless.schedulers.ledger import CostLedger

from .config import Config


@dataclass(frozen=True)
class Pool:
    name: str
    size: int
    threads: int  # Dask threads per worker = torch threads of its engine
    resources: dict[str, float] = field(default_factory=dict)
    memory: str = "4GiB"


def pools_from_config(cfg: Config, elastic: bool = False) -> list[Pool]:
    """The generation pool and the trainer; an elastic pool starts with one worker and
    grows as the policy decides."""
    return [
        Pool("gen", 1 if elastic else cfg.gen_workers, cfg.gen_threads, {"GEN": 1},
             cfg.worker_memory),
        Pool("train", 1, cfg.train_threads, {"TRAIN": 1}, cfg.worker_memory),
    ]


def pool_of(worker_name: str) -> str:
    return worker_name.rsplit("-", 1)[0]


class PoolCluster:
    """A ``LocalCluster`` whose workers are the members of named pools.

    Every start and stop goes to the ``CostLedger``: billing starts when a worker is
    requested (process start and model load are part of its cold start) and ends when the
    scheduler sees it leave. ``ElasticityPlugin`` reports arrivals, departures and task spans.
    """

    def __init__(self, pools: list[Pool], ledger: CostLedger, host: str = "127.0.0.1",
                 dashboard_address: str = "127.0.0.1:0") -> None:
        self.pools = {p.name: p for p in pools}
        self.ledger = ledger
        self.task_events: list[tuple] = []
        self.cluster = LocalCluster(
            n_workers=0, processes=True, host=host, dashboard_address=dashboard_address,
            silence_logs=logging.WARNING, scheduler_kwargs={"plugins": [ElasticityPlugin()]},
        )
        self.client = Client(self.cluster)
        for pool in pools:
            self.grow(pool.name, pool.size, wait=False)
        self.client.wait_for_workers(sum(p.size for p in pools))
        self.sync_events()

    def worker_names(self, pool: str) -> list[str]:
        return sorted((n for n in self.cluster.worker_spec if pool_of(n) == pool),
                      key=lambda n: int(n.rsplit("-", 1)[1]))

    def address_of(self, name: str) -> str:
        for address, info in self.client.scheduler_info(n_workers=-1)["workers"].items():
            if str(info["name"]) == name:
                return address
        raise KeyError(f"worker {name!r} is not connected")

    def grow(self, pool: str, n: int, wait: bool = True) -> list[str]:
        """Start ``n`` more workers of ``pool``; returns their names."""
        spec, names, i = self.pools[pool], [], 0
        while len(names) < n:
            name = f"{pool}-{i}"
            if name not in self.cluster.worker_spec:
                self.cluster.worker_spec[name] = {"cls": Nanny, "options": _worker_options(spec)}
                self.ledger.worker_started(name, pool, time.time())
                names.append(name)
            i += 1
        # SpecCluster.scale applies worker_spec edits the same way
        self.cluster.sync(self.cluster._correct_state)
        if wait and names:
            self.client.wait_for_workers(len(self.cluster.worker_spec))
            self.sync_events()
        return names

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
            self.cluster.sync(self.cluster._correct_state)  # returns once the processes exit
            stopped = time.time()
            for name in allowed:
                if name in self.ledger.running():
                    self.ledger.worker_stopped(name, stopped)
        self.sync_events()
        return allowed

    def sync_events(self) -> None:
        """Move the scheduler plugin's events into the ledger and ``task_events``. A worker
        that leaves without being retired (it crashed, or the batch system ended it) stops
        billing when the scheduler saw it go."""
        for kind, t, name, details in self.client.run_on_scheduler(drain_events):
            if kind == "arrive":
                if name not in self.ledger.running():  # restarted by its nanny after a crash
                    self.ledger.worker_started(name, pool_of(name), t)
                self.ledger.worker_ready(name, t)
            elif kind == "depart" and name in self.ledger.running():
                self.ledger.worker_stopped(name, t)
            elif kind == "task":
                self.task_events.append((name, details))

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


def _worker_options(spec: Pool) -> dict:
    return {
        "nthreads": spec.threads,
        "resources": dict(spec.resources),
        "memory_limit": spec.memory,
        "silence_logs": logging.WARNING,
        "env": {
            "OMP_NUM_THREADS": str(spec.threads),
            "TRANSFORMERS_VERBOSITY": "error",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        },
    }
