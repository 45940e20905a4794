"""Network safety of a run's Dask cluster: where it listens, and who may connect.

Safe by default, for a local cluster and for batch-job (Slurm/PBS) clusters alike:

* Every connection is TLS with mutual authentication. Each time a run starts (or resumes)
  it makes a fresh key and self-signed certificate (``Security.temporary()``) and writes them
  to ``<run>/tls/`` (directory 0700, files 0600): the certificate is the only authority a peer
  may chain to, so a scheduler, worker, nanny or client must hold the run's key, which only
  the run's Unix user can read. Another local user can reach the ports but not finish a
  handshake, so cannot run code on the workers. Batch jobs get the files' paths on the worker
  command line (``--tls-key ...``), never their content: the job script reveals nothing.
* The scheduler, its HTTP server and every local worker listen on 127.0.0.1 (config keys
  ``scheduler_host``, ``dashboard_address``); nothing listens on all interfaces unless
  configured to. The dashboard is off unless ``dashboard = true``: without it the scheduler's
  HTTP server answers its health check only; with it, it is plain HTTP and read-only
  (distributed's default routes: status pages, JSON, Prometheus; none submits work), so that
  another local user can watch a run's progress there, not change it (observe.py).
* The trainer ranks (``train_workers > 1``) meet through a file in the run's 0700
  ``ranks/`` directory, not a TCP store: no port, no key another user can read or set; their
  collectives bind to the interface of their Dask address (ranks.py).
* A run's files are 0600 and its directories 0700 (``run_umask``, runs.py).

The config's ``[security]`` table:

    [security]
    enabled = false                   # opt out: plain tcp:// on 127.0.0.1, anyone local may
                                      # connect (a machine of your own, a trusted site)
    # or bring your own certificates (every key passes to distributed.security.Security):
    require_encryption = true         # default true
    tls_ca_file = "ca.pem"            # the authority every peer's certificate must chain to
    tls_client_cert = "client.pem"    # this driver's client
    tls_client_key = "client.key"
    tls_scheduler_cert = "sched.pem"  # a cluster also needs the scheduler's and the
    tls_scheduler_key = "sched.key"   # workers' (one certificate may serve every role)
    tls_worker_cert = "worker.pem"
    tls_worker_key = "worker.key"

Checked when the config is read (keys and types) and when the cluster starts (files exist).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from distributed.security import Security

from ..config import SECURITY_KEYS, check_security

FILE_KEYS = tuple(k for k in SECURITY_KEYS if k.endswith(("_file", "_cert", "_key")))
ROLES = ("client", "scheduler", "worker")


def enabled(section: Mapping[str, Any]) -> bool:
    return section.get("enabled", True)


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to a new file only this user can read (mode 0600 from the start)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def run_credentials(directory: Path) -> Security:
    """A fresh key and self-signed certificate for every role, in ``directory`` (0700,
    files 0600), as a ``Security`` that requires TLS and the certificate of every peer."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)
    temporary = Security.temporary()  # the PEM text itself, in memory
    cert, key = directory / "cert.pem", directory / "key.pem"
    _write_private(cert, temporary.tls_ca_file)
    _write_private(key, temporary.tls_client_key)
    files = {f"tls_{role}_{part}": str(path) for role in ROLES
             for part, path in (("cert", cert), ("key", key))}
    return Security(tls_ca_file=str(cert), require_encryption=True, **files)


def make_security(section: Mapping[str, Any], run_path: str | Path) -> Security | None:
    """The ``Security`` of a run: per-run credentials in ``<run_path>/tls`` by default, the
    files of the ``[security]`` table if it names any, None with ``enabled = false``."""
    check_security(section)
    if not enabled(section):
        return None
    given = {k: v for k, v in section.items() if k != "enabled"}
    if not any(k in given for k in FILE_KEYS):
        if given:
            raise ValueError(f"security settings {sorted(given)} without certificates: name "
                             "them (tls_ca_file, tls_<role>_cert/key) or remove the settings "
                             "to use the run's own")
        return run_credentials(Path(run_path) / "tls")
    for key in FILE_KEYS:
        if key in given and not Path(given[key]).is_file():
            raise FileNotFoundError(f"security.{key} = {given[key]!r}: no such file")
    return Security(**{"require_encryption": True, **given})
