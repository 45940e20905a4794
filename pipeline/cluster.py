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
from dataclasses import dataclass, field

from distributed import Client, LocalCluster, Nanny

from .config import Config


@dataclass(frozen=True)
class Pool:
    name: str
    size: int
    threads: int  # Dask threads per worker = torch threads of its engine
    resources: dict[str, float] = field(default_factory=dict)
    memory: str = "4GiB"


def pools_from_config(cfg: Config) -> list[Pool]:
    return [
        Pool("gen", cfg.gen_workers, cfg.gen_threads, {"GEN": 1}, cfg.worker_memory),
        Pool("train", 1, cfg.train_threads, {"TRAIN": 1}, cfg.worker_memory),
    ]


class PoolCluster:
    """A ``LocalCluster`` whose workers are the members of named pools."""

    def __init__(self, pools: list[Pool], host: str = "127.0.0.1",
                 dashboard_address: str = "127.0.0.1:0") -> None:
        self.pools = {p.name: p for p in pools}
        self.cluster = LocalCluster(
            n_workers=0, processes=True, host=host, dashboard_address=dashboard_address,
            silence_logs=logging.WARNING,
        )
        self.client = Client(self.cluster)
        for pool in pools:
            self.scale(pool.name, pool.size, wait=False)
        self.client.wait_for_workers(sum(p.size for p in pools))

    def worker_names(self, pool: str) -> list[str]:
        return sorted(n for n in self.cluster.worker_spec if n.rsplit("-", 1)[0] == pool)

    def scale(self, pool: str, n: int, wait: bool = True) -> None:
        """Set the size of ``pool`` to ``n`` workers (highest-numbered ones leave first)."""
        spec = self.pools[pool]
        names = self.worker_names(pool)
        for name in names[n:]:
            del self.cluster.worker_spec[name]
        used = {int(x.rsplit("-", 1)[1]) for x in names[:n]}
        i = 0
        while len(used) < n:
            if i not in used:
                self.cluster.worker_spec[f"{pool}-{i}"] = {
                    "cls": Nanny,
                    "options": {
                        "nthreads": spec.threads,
                        "resources": dict(spec.resources),
                        "memory_limit": spec.memory,
                        "silence_logs": logging.WARNING,
                        "env": {
                            "OMP_NUM_THREADS": str(spec.threads),
                            "TRANSFORMERS_VERBOSITY": "error",
                            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                        },
                    },
                }
                used.add(i)
            i += 1
        # SpecCluster.scale applies worker_spec edits the same way
        self.cluster.sync(self.cluster._correct_state)
        if wait:
            self.client.wait_for_workers(len(self.cluster.worker_spec))

    @property
    def dashboard_link(self) -> str:
        return self.cluster.dashboard_link

    def close(self) -> None:
        self.client.close()
        self.cluster.close()

    def __enter__(self) -> PoolCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
