"""Where the pools' workers run: processes on this machine, or Slurm / PBS batch jobs.

A ``Deployment`` makes the one Dask ``SpecCluster`` that serves every pool, with
``PoolScaling`` mixed in (workers named ``<pool>-<i>``; ``scale_pool`` grows a pool through
SpecCluster's own ``scale``), and turns a ``Pool`` into one ``worker_spec`` entry per worker.
``PoolCluster`` does the rest (adaptive scaling, retiring, billing) the same way for every
deployment, so the elastic policy scales batch jobs exactly as it scales local processes.

* ``LocalDeployment``: a ``distributed.LocalCluster`` with no workers of its own; a pool's
  worker is ``{"cls": PoolNanny, "options": ...}`` (threads, resources, memory, environment).
* ``JobQueueDeployment``: a dask-jobqueue ``SLURMCluster`` or ``PBSCluster`` (SpecClusters
  whose scheduler runs in this process); a pool's worker is one batch job of one worker
  process, ``{"cls": SLURMJob | PBSJob, "options": job keywords}``, with per-pool directives:
  cores = the pool's threads, its memory, ``--gres=gpu:N`` (Slurm) or ``ngpus=N`` (PBS) when
  the pool asks for GPUs, the queue / partition, account and walltime, the pool's extra
  directives, and the worker arguments ``--resources GEN=1`` (the pool's resources) and
  ``--lifetime`` / ``--lifetime-stagger`` so that a worker leaves gracefully before the batch
  system kills it at the walltime.

Both are TLS with mutual authentication by default (``security.py``): the local deployment
hands its ``Security`` to the scheduler, every nanny and worker; a batch job's worker gets
the paths of the run's certificate and key (files only the run's user can read, on the
shared file system) as ``--tls-*`` arguments and speaks ``tls://``.

Billing (``CostLedger``) starts when a job is submitted, queue wait included: the ledger is
an upper bound of what the site charges. dask-jobqueue is imported only by the jobqueue
deployment (the ``hpc`` extra).
"""

from __future__ import annotations

import logging
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dask
from dask.utils import parse_bytes, parse_timedelta
from distributed import LocalCluster, Nanny, SpecCluster
from distributed.core import Status
from distributed.deploy.cluster import Cluster
from distributed.security import Security

from rlhfless.schedulers.dask.plugin import pool_of

from ..config import Config, walltime_seconds
from .security import make_security
from .sitemap import install_sitemap

# what every worker of every pool is told through its environment
WORKER_ENV = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
# glibc malloc of every worker process, set before it starts. Dask's nanny exports
# MALLOC_TRIM_THRESHOLD_=64KiB, and setting any malloc threshold freezes glibc's adaptive mmap
# threshold at 128 KiB: every activation and gradient above it is then mmap'd and unmapped
# afresh, page faults and all, and a torch update ran 1.7-2x slower (bench/worker_malloc.py).
# These are the values glibc's adaptive thresholds reach by themselves on 64-bit Linux.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(64 << 20)}
JOB_SYSTEMS = ("slurm", "pbs")


@dataclass(frozen=True)
class Pool:
    """A worker template: every worker of the pool is started from it."""

    name: str
    size: int
    threads: int  # Dask threads per worker = torch threads of its engine
    resources: dict[str, float] = field(default_factory=dict)
    memory: str = "4GiB"
    gpus: int = 0  # GPUs per worker: a batch job asks for them (--gres=gpu:N / ngpus=N)
    directives: tuple[str, ...] = ()  # extra batch-job directives of this pool
    # modules every worker imports before it registers (Dask's ``preload``): the pool's task
    # code, so that its worker process imports torch and transformers while the other pools'
    # workers do, not when its first task arrives
    preload: tuple[str, ...] = ()
    # environment every worker starts with besides WORKER_ENV: the run's Dask bounds
    # (``supervise.dask_environment``), which a worker on another host reads only there
    env: dict[str, str] = field(default_factory=dict)


def scheduler_http(dashboard: bool) -> AbstractContextManager:
    """Dask's config for a scheduler made in the block (in this process): with the dashboard,
    distributed's pages and a ``/sitemap.json`` that no longer raises on the dashboard's
    routes (``sitemap.Sitemap``); without it, the HTTP server (Dask always starts one, on
    ``dashboard_address``) answers its health check only."""
    if dashboard:
        install_sitemap()
        return nullcontext()
    return dask.config.set({"distributed.scheduler.http.routes": ["distributed.http.health"]})


class PoolScaling:
    """Mixed in before a SpecCluster (``LocalCluster``, dask-jobqueue's clusters): workers
    belong to named pools, ``<pool>-<i>``, and ``scale_pool`` grows one pool through
    SpecCluster's own ``scale``, whose ``new_worker_spec`` hook picks the pool short of its
    count. Workers leave by name through SpecCluster's ``scale_down``. A name is never
    reused: SpecCluster closes a lost worker by name after a delay, which would stop a new
    worker of the same name that has not connected yet (a queued job).

    A worker of one of ``replaced_pools`` that leaves unasked (a batch job that ended, a host
    cut off and removed) is replaced at once, from the cluster's own event loop: taken out of
    the plan (SpecCluster then closes it) and a new one requested. The driver waits on the
    pool's task (the trainer's update), which would otherwise wait for a worker for ever;
    the driver grows a pool only between tasks. ``PoolCluster`` names the fixed pools of a
    deployment whose workers do not come back by themselves."""

    replaced_pools: frozenset[str] = frozenset()
    replaced_at: dict[str, float]  # replacement's name -> when it was requested (its billing)

    def set_pools(self, specs: Mapping[str, Callable[[str], dict[str, Any]]]) -> None:
        """``specs``: pool -> the ``worker_spec`` entry of a worker of that name."""
        self.pool_specs = dict(specs)
        self.replaced_at = {}
        self._wanted = dict.fromkeys(specs, 0)
        self._next_index = dict.fromkeys(specs, 0)

    def pool_members(self, pool: str) -> list[str]:
        """Names of ``pool``'s workers in the cluster's plan, oldest first."""
        return sorted((str(n) for n in self.worker_spec if pool_of(n) == pool),
                      key=lambda n: int(n.rsplit("-", 1)[1]))

    def scale_pool(self, pool: str, n: int) -> list[str]:
        """Grow ``pool`` to ``n`` workers (never shrinks it); returns the new names."""
        return self.scale_pools({pool: n})

    def scale_pools(self, sizes: Mapping[str, int]) -> list[str]:
        """Grow each pool of ``sizes`` to its count (never shrinks one) in one ``scale``, so
        that their workers start together: SpecCluster opens the workers of one ``scale``
        concurrently, but a second ``scale`` waits for the first one's workers to start
        (their imports and preloads). Returns the new names."""
        before = set(self.worker_spec)
        self._wanted = {p: len(self.pool_members(p)) for p in self.pool_specs}
        for pool, n in sizes.items():
            self._wanted[pool] = max(n, self._wanted[pool])
        self.scale(sum(self._wanted.values()))
        return sorted(set(self.worker_spec) - before)

    def _update_worker_status(self, op, msg) -> None:
        if op == "remove":
            self._replace_lost(msg)
        super()._update_worker_status(op, msg)

    def _replace_lost(self, address: str) -> None:
        name = str(self.scheduler_info["workers"].get(address, {}).get("name", ""))
        pool = pool_of(name) if name else ""
        if (pool in self.replaced_pools and name in self.worker_spec
                and self.status == Status.running):
            members = len(self.pool_members(pool))
            del self.worker_spec[name]
            self.replaced_at |= dict.fromkeys(self.scale_pools({pool: members}), time.time())

    def new_worker_spec(self) -> dict[str, dict[str, Any]]:
        pool = next(p for p, n in self._wanted.items() if len(self.pool_members(p)) < n)
        name = f"{pool}-{self._next_index[pool]}"
        self._next_index[pool] += 1
        return {name: self.pool_specs[pool](name)}


class PoolLocalCluster(PoolScaling, LocalCluster):
    """A ``LocalCluster`` of pools. A worker that dies is its nanny's to restart, however
    long the restart takes: SpecCluster closes the nanny of a worker that is not back
    within ``distributed.deploy.lost-worker-timeout`` (15 s, less than a worker's imports
    take on a loaded machine), which left its pool a member short for good (a killed
    trainer rank never came back, and the run could not form its group again)."""

    def _update_worker_status(self, op, msg) -> None:
        if op == "remove":
            self._replace_lost(msg)
        Cluster._update_worker_status(self, op, msg)  # SpecCluster's, without the close


class Deployment(ABC):
    """Makes the cluster and the per-worker specs. ``make_cluster`` is called once, by
    ``PoolCluster.__init__``; ``worker_spec`` every time a pool grows by one worker."""

    #: seconds ``PoolCluster.grow`` waits for requested workers to connect (None: forever)
    start_timeout_s: float | None = None
    #: whether the scheduler serves Dask's dashboard (config ``dashboard``)
    dashboard: bool = False
    #: whether a worker that left unasked comes back by itself (a nanny restarts a crashed
    #: local worker; a batch job that ended, at its walltime or lifetime, does not)
    restarts_workers: bool = True

    @abstractmethod
    def make_cluster(self, plugins: list) -> PoolScaling:
        """A SpecCluster of pools (``PoolScaling``) with no workers whose scheduler runs
        ``plugins``."""

    @abstractmethod
    def worker_spec(self, pool: Pool, name: str) -> dict[str, Any]:
        """The ``worker_spec`` entry of worker ``name`` of ``pool``."""

    def describe(self, cluster: SpecCluster, names: list[str]) -> str:
        """A line about workers that did not connect in time, for the error message."""
        return ""


class PoolNanny(Nanny):
    """A ``Nanny`` whose worker process starts with ``MALLOC_ENV``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pre_spawn_env.update(MALLOC_ENV)  # the worker process starts with these
        self.env.update(MALLOC_ENV)  # and its os.environ keeps them


@dataclass(frozen=True)
class LocalDeployment(Deployment):
    host: str = "127.0.0.1"
    dashboard_address: str = "127.0.0.1:0"
    security: Security | None = None  # TLS of scheduler, workers and client (security.py)
    start_timeout_s: float | None = 300.0  # a local worker not connected by then is an error
    dashboard: bool = False  # serve the scheduler's dashboard (scheduler_http)

    def make_cluster(self, plugins: list) -> PoolScaling:
        with scheduler_http(self.dashboard):
            return PoolLocalCluster(n_workers=0, processes=True, host=self.host,
                                    dashboard_address=self.dashboard_address,
                                    security=self.security, silence_logs=logging.WARNING,
                                    scheduler_kwargs={"plugins": plugins,
                                                      "dashboard": self.dashboard})

    def worker_spec(self, pool: Pool, name: str) -> dict[str, Any]:
        return {"cls": PoolNanny, "options": {
            "host": self.host, "security": self.security,  # listen where the scheduler does
            "nthreads": pool.threads,
            "resources": dict(pool.resources),
            "memory_limit": pool.memory,
            "silence_logs": logging.WARNING,
            "env": {"OMP_NUM_THREADS": str(pool.threads), **WORKER_ENV, **pool.env},
            "preload": list(pool.preload),
        }}

    def describe(self, cluster: SpecCluster, names: list[str]) -> str:
        return ("local worker processes start by spawn and import the driver's main module: "
                "a script that starts a run must do so under `if __name__ == \"__main__\":`")


@dataclass(frozen=True)
class JobSettings:
    """Site settings shared by every pool's jobs (config keys of the same names)."""

    system: str  # "slurm" | "pbs"
    queue: str = ""  # Slurm partition / PBS queue; empty: the site's default
    account: str = ""
    walltime: str = "01:00:00"
    lifetime: str = ""  # dask worker --lifetime; empty: 90% of the walltime
    prologue: tuple[str, ...] = ()  # shell lines before the worker starts
    log_directory: str = ""  # job stdout/stderr; empty: the batch system's default
    scheduler_host: str = "127.0.0.1"
    interface: str = ""  # network interface of scheduler and workers (e.g. "ib0")
    dashboard_address: str = "127.0.0.1:0"
    python: str = field(default=sys.executable)
    start_timeout_s: float = 600.0
    umask: int = 0o077  # of every job's shell, so that its worker writes as the driver does
    dashboard: bool = False  # serve the scheduler's dashboard (scheduler_http)

    def __post_init__(self) -> None:
        if self.system not in JOB_SYSTEMS:
            raise ValueError(f"job system {self.system!r}: choose one of {JOB_SYSTEMS}")
        walltime_seconds(self.walltime)  # raises on a bad walltime
        if self.lifetime:
            parse_timedelta(self.lifetime)


class JobQueueDeployment(Deployment):
    """Every worker is one batch job; see the module docstring for the directives."""

    restarts_workers = False

    def __init__(self, settings: JobSettings, job_name_prefix: str = "rlhfless",
                 security: Security | None = None) -> None:
        self.settings = settings
        self.prefix = job_name_prefix
        self.security = security  # file-based: its paths go on the worker command line
        self.start_timeout_s = settings.start_timeout_s
        self.dashboard = settings.dashboard

    def _jobqueue(self):
        try:
            import dask_jobqueue
        except ImportError as err:
            raise ImportError(
                f"cluster = {self.settings.system!r} needs dask-jobqueue: "
                "pip install 'rlhfless[hpc]'") from err
        return dask_jobqueue

    def _classes(self) -> tuple[type, type]:
        jq = self._jobqueue()
        if self.settings.system == "slurm":
            return jq.SLURMCluster, jq.slurm.SLURMJob
        return jq.PBSCluster, jq.pbs.PBSJob

    def lifetime(self) -> tuple[str, str]:
        """(--lifetime, --lifetime-stagger): leave before the walltime, not all at once."""
        if self.settings.lifetime:
            total = parse_timedelta(self.settings.lifetime)
            return self.settings.lifetime, f"{max(1, int(total * 0.05))}s"
        wall = walltime_seconds(self.settings.walltime)
        return f"{int(wall * 0.9)}s", f"{max(1, int(wall * 0.05))}s"

    def job_options(self, pool: Pool) -> dict[str, Any]:
        """The job keywords of one worker of ``pool`` (dask-jobqueue ``Job`` arguments)."""
        s = self.settings
        lifetime, stagger = self.lifetime()
        resources = ",".join(f"{k}={v:g}" for k, v in sorted(pool.resources.items()))
        worker_args = ["--lifetime", lifetime, "--lifetime-stagger", stagger,
                       *(arg for module in pool.preload for arg in ("--preload", module))]
        if resources:
            worker_args = ["--resources", resources, *worker_args]
        env = {"OMP_NUM_THREADS": str(pool.threads), **WORKER_ENV, **MALLOC_ENV, **pool.env}
        options: dict[str, Any] = {
            "cores": pool.threads,
            "memory": pool.memory,
            "processes": 1,
            "walltime": s.walltime,
            "job_name": f"{self.prefix}-{pool.name}",
            "job_extra_directives": list(pool.directives),
            "worker_extra_args": worker_args,
            "job_script_prologue": [f"umask {s.umask:03o}",
                                    *(f"export {k}={v}" for k, v in env.items()), *s.prologue],
            "python": s.python,
        }
        if self.security is not None:
            options |= {"security": self.security, "protocol": "tls://"}
        if s.queue:
            options["queue"] = s.queue
        if s.account:
            options["account"] = s.account
        if s.log_directory:
            options["log_directory"] = s.log_directory
        if s.interface:
            options["interface"] = s.interface
        if s.system == "slurm" and pool.gpus:
            options["job_extra_directives"].insert(0, f"--gres=gpu:{pool.gpus}")
        elif s.system == "pbs":
            mem = self._jobqueue().pbs.pbs_format_bytes_ceil(parse_bytes(pool.memory))
            gpus = f":ngpus={pool.gpus}" if pool.gpus else ""
            options["resource_spec"] = f"select=1:ncpus={pool.threads}:mem={mem}{gpus}"
        return options

    def make_cluster(self, plugins: list) -> PoolScaling:
        jobs_cls, _ = self._classes()
        cluster_cls = type(f"Pool{jobs_cls.__name__}", (PoolScaling, jobs_cls), {})
        s = self.settings
        scheduler: dict[str, Any] = {"dashboard_address": s.dashboard_address,
                                     "dashboard": s.dashboard, "plugins": plugins}
        if s.interface:
            scheduler["interface"] = s.interface
        else:
            scheduler["host"] = s.scheduler_host
        # cores/memory here only validate the template; every pool brings its own
        with scheduler_http(s.dashboard):
            return cluster_cls(cores=1, memory="1GiB", processes=1, walltime=s.walltime,
                               scheduler_options=scheduler, silence_logs=logging.WARNING,
                               python=s.python, security=self.security)

    def worker_spec(self, pool: Pool, name: str) -> dict[str, Any]:
        _, job_cls = self._classes()
        return {"cls": job_cls, "options": self.job_options(pool)}

    def job_script(self, pool: Pool, name: str | None = None,
                   scheduler: str = "tcp://scheduler-address:8786") -> str:
        """The batch script one worker of ``pool`` would be submitted with."""
        _, job_cls = self._classes()
        job = job_cls(scheduler, name=name or f"{pool.name}-0", **self.job_options(pool))
        return job.job_script()

    def describe(self, cluster: SpecCluster, names: list[str]) -> str:
        jobs = {n: getattr(cluster.workers.get(n), "job_id", None) for n in names}
        return (f"{self.settings.system} jobs {jobs} did not start a connected worker; "
                f"check the queue and the job logs ({self.settings.log_directory or 'cwd'})")


def deployment_from_config(cfg: Config, run_path: str | Path) -> Deployment:
    """The deployment of ``cfg.cluster``; batch jobs log under ``<run>/jobs``. Its TLS
    credentials are the run's own, in ``<run>/tls``, unless ``[security]`` says otherwise."""
    security = make_security(cfg.security, run_path)
    if cfg.cluster == "local":
        return LocalDeployment(cfg.scheduler_host, cfg.dashboard_address, security,
                               dashboard=cfg.dashboard)
    settings = JobSettings(
        system=cfg.cluster, queue=cfg.queue, account=cfg.account, walltime=cfg.walltime,
        lifetime=cfg.worker_lifetime, prologue=tuple(cfg.job_prologue),
        log_directory=str(Path(run_path).resolve() / "jobs"),
        scheduler_host=cfg.scheduler_host, interface=cfg.interface,
        dashboard_address=cfg.dashboard_address, start_timeout_s=cfg.job_start_timeout_s,
        umask=cfg.run_umask, dashboard=cfg.dashboard)
    return JobQueueDeployment(settings, job_name_prefix=f"rlhfless-{cfg.name}",
                              security=security)
