"""Network safety of a run's Dask cluster: where it listens, and TLS.

Safe by default: the scheduler, its dashboard and every local worker listen on 127.0.0.1
(config keys ``scheduler_host``, ``dashboard_address``); nothing listens on all interfaces
unless configured to. The config's ``[security]`` table passes through to
``distributed.security.Security``, for the cluster and the client alike:

    [security]
    require_encryption = true         # every connection is tls://
    tls_ca_file = "ca.pem"            # the authority every peer's certificate must chain to
    tls_client_cert = "client.pem"    # this driver's client
    tls_client_key = "client.key"
    tls_scheduler_cert = "sched.pem"  # a local cluster also needs the scheduler's and the
    tls_scheduler_key = "sched.key"   # workers' (one certificate may serve every role)
    tls_worker_cert = "worker.pem"
    tls_worker_key = "worker.key"

An empty table leaves distributed's own configuration in charge (``distributed.comm.tls``).
Checked when the config is read (keys and types) and when the cluster starts (files exist).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from distributed.security import Security

SECURITY_KEYS: dict[str, type] = {
    "require_encryption": bool, "tls_ca_file": str, "tls_ciphers": str,
    "tls_client_cert": str, "tls_client_key": str, "tls_scheduler_cert": str,
    "tls_scheduler_key": str, "tls_worker_cert": str, "tls_worker_key": str,
}
FILE_KEYS = tuple(k for k in SECURITY_KEYS if k.endswith(("_file", "_cert", "_key")))


def check_security(section: Mapping[str, Any]) -> None:
    """``ValueError`` (one line) for an unknown key or a value of the wrong type."""
    for key, value in section.items():
        kind = SECURITY_KEYS.get(key)
        if kind is None:
            raise ValueError(f"security.{key} is not a security setting; known: "
                             f"{', '.join(sorted(SECURITY_KEYS))}")
        if not isinstance(value, kind):
            raise ValueError(f"security.{key} = {value!r} must be of type {kind.__name__}")


def make_security(section: Mapping[str, Any]) -> Security | None:
    """The ``Security`` of a ``[security]`` table, or None for an empty one."""
    if not section:
        return None
    check_security(section)
    for key in FILE_KEYS:
        if key in section and not Path(section[key]).is_file():
            raise FileNotFoundError(f"security.{key} = {section[key]!r}: no such file")
    return Security(**dict(section))

