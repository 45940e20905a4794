"""A run's workers on hosts of a ``Network``: each worker a ``dask worker`` on a host of its own.

``HostsDeployment`` is a ``Deployment`` (``pipeline/cluster/deploy.py``) for ``train``: the
scheduler is the local deployment's (in the driver, listening on ``scheduler_host``, TLS with
the run's credentials), and every worker of every pool is started the way a batch job starts
it on another node: ``python -m distributed.cli.dask_worker`` with a nanny, on its host
(``Network.spawn``), told ``--interface eth0`` (the config's ``interface``), the pool's
threads, memory, resources and task modules (``--preload``) and the run's TLS files, with
the environment every worker gets. Like a batch job, a worker that left unasked is not
expected back (``restarts_workers = False``): a host cut off and declared lost, or killed,
leaves its pool, and closing a worker ends every process of its host.

``placement`` says which host runs which worker (``gen-0`` -> a host); a worker with no host
is an error, since a pool cannot grow past the hosts a test gave it. The workers of the
pools in ``unshared`` start in a mount namespace of their own in which the run directory is
an empty file system but for its ``tls/`` (the run's credentials, which a site without a
shared disk puts on each node): they see none of the run's files. ``deploy_on_hosts`` makes
``train`` use it: every loaded module of the pipeline that took ``deployment_from_config``
by name gets one that returns a ``HostsDeployment`` with the run's own TLS credentials
(``make_security``, as the run would make them).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

from distributed.deploy.spec import ProcessInterface
from distributed.security import Security
from netns_hosts import HOST_LINK, Host, Network

import rlhfless.pipeline.train.loop  # noqa: F401  (the modules deploy_on_hosts patches)
from rlhfless.pipeline.cluster import deploy
from rlhfless.pipeline.cluster.deploy import (
    MALLOC_ENV,
    WORKER_ENV,
    Deployment,
    LocalDeployment,
    Pool,
    PoolScaling,
)
from rlhfless.pipeline.cluster.security import make_security


def worker_argv(scheduler: str, name: str, pool: Pool, security: Security | None,
                local_directory: Path) -> list[str]:
    """The command line of a worker of ``pool``, as a batch job on another node runs it."""
    argv = [sys.executable, "-m", "distributed.cli.dask_worker", scheduler, "--name", name,
            "--nanny", "--interface", HOST_LINK, "--nthreads", str(pool.threads),
            "--memory-limit", pool.memory, "--local-directory", str(local_directory)]
    if pool.resources:
        argv += ["--resources", ",".join(f"{k}={v:g}" for k, v in pool.resources.items())]
    for module in pool.preload:
        argv += ["--preload", module]
    if security is not None:
        argv += ["--tls-ca-file", security.tls_ca_file, "--tls-cert", security.tls_worker_cert,
                 "--tls-key", security.tls_worker_key]
    return argv


class HostWorker(ProcessInterface):
    """One worker (with its nanny) on one host; closing it ends every process there."""

    def __init__(self, scheduler: str, name: str, network: Network, host: Host,
                 pool: Pool, security: Security | None, logs: Path,
                 hidden_run: Path | None) -> None:
        super().__init__(scheduler, name)
        self.scheduler, self.name, self.network, self.host = scheduler, name, network, host
        self.pool, self.security, self.logs, self.hidden_run = pool, security, logs, hidden_run

    async def start(self) -> None:
        env = {"OMP_NUM_THREADS": str(self.pool.threads), **WORKER_ENV, **MALLOC_ENV,
               **self.pool.env}
        argv = ["env", *(f"{k}={v}" for k, v in env.items()),
                *worker_argv(self.scheduler, self.name, self.pool, self.security,
                             self.logs / self.name)]
        if self.hidden_run is not None:
            argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    self.hide_run(), "sh", *argv]
        self.network.spawn(self.host, argv, self.logs / f"{self.name}.log")
        await super().start()

    def hide_run(self) -> str:
        """The shell lines that hide the run directory but its ``tls/``, then run ``$@``."""
        keep = self.logs / f"{self.name}-tls"
        keep.mkdir(parents=True, exist_ok=True)
        run, tls, kept = (shlex.quote(str(p)) for p in
                          (self.hidden_run, self.hidden_run / "tls", keep))
        return (f"mount --bind {tls} {kept} && mount -t tmpfs -o size=1m,mode=0700 run {run}"
                f" && mkdir {tls} && mount --bind {kept} {tls} && exec \"$@\"")

    async def close(self) -> None:
        self.network.kill(self.host)
        await super().close()


class HostsDeployment(Deployment):
    """See the module docstring."""

    restarts_workers = False
    start_timeout_s = 300.0

    def __init__(self, network: Network, placement: dict[str, Host],
                 security: Security | None, logs: Path, run: Path,
                 unshared: frozenset[str] = frozenset()) -> None:
        self.network, self.placement, self.security = network, placement, security
        self.logs, self.run, self.unshared = logs, run, unshared
        self.local = LocalDeployment(network.driver_address, f"{network.driver_address}:0",
                                     security)

    def make_cluster(self, plugins: list) -> PoolScaling:
        return self.local.make_cluster(plugins)

    def worker_spec(self, pool: Pool, name: str) -> dict[str, Any]:
        if name not in self.placement:
            raise RuntimeError(f"worker {name}: no host for it (hosts: {sorted(self.placement)})")
        self.logs.mkdir(parents=True, exist_ok=True)
        return {"cls": HostWorker, "options": {
            "network": self.network, "host": self.placement[name], "pool": pool,
            "security": self.security, "logs": self.logs,
            "hidden_run": self.run if pool.name in self.unshared else None}}

    def describe(self, cluster, names: list[str]) -> str:
        return f"their logs are in {self.logs}"


def deploy_on_hosts(monkeypatch, network: Network, placement: dict[str, Host],
                    logs: Path, unshared: frozenset[str] = frozenset()) -> None:
    """Runs started while ``monkeypatch`` holds put their workers on ``placement``'s hosts,
    those of the pools ``unshared`` without the run directory."""
    def on_hosts(cfg, run_path) -> HostsDeployment:
        return HostsDeployment(network, placement, make_security(cfg.security, run_path), logs,
                               Path(run_path).resolve(), unshared)

    users = [m for name, m in sys.modules.items() if name.startswith("rlhfless.pipeline.")
             and getattr(m, "deployment_from_config", None) is deploy.deployment_from_config
             and m is not deploy]
    if not users:
        raise RuntimeError("no pipeline module builds its deployment by deployment_from_config")
    for module in users:
        monkeypatch.setattr(module, "deployment_from_config", on_hosts)
