"""Where a generation worker's agent endpoint listens, and how its agents trust it.

``agent_host = "loopback"`` (the default): 127.0.0.1, plain HTTP; only processes of this
machine reach it, and the agents it serves are the worker's own child processes.
``agent_host = "worker"``: the host of the Dask worker's own address (loopback on a local
cluster, the ``interface``'s address for batch jobs), so that agents on other machines can
reach it. When the run's cluster speaks TLS (its default, ``pipeline/cluster/security.py``)
the endpoint there serves HTTPS with the worker's certificate and key, and agents verify it
against the run's authority alone (``agent_trust``); on a plain-tcp cluster it is plain
HTTP. Outside a Dask worker (a test, a notebook) "worker" falls back to loopback.

Either way a request needs the bearer key of an open episode: keys are drawn per episode
(``secrets.token_urlsafe``) by the endpoint that serves it, and every run's workers run
endpoints of their own, so a key of one run is unknown to (401 on) any other run's endpoint.
Agents hold no client certificate: the key admits a request, TLS keeps it private.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # distributed is imported where an endpoint binds, never in the agent process
    from distributed.security import Security

AGENT_HOSTS = ("loopback", "worker")  # the values of the config key agent_host
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Binding:
    """Where an endpoint listens: ``tls`` its server context (None: plain HTTP) and
    ``ca_pem`` the authority its agents verify the certificate with."""

    host: str = LOOPBACK
    tls: ssl.SSLContext | None = None
    ca_pem: str | None = None

    @property
    def scheme(self) -> str:
        return "http" if self.tls is None else "https"


def endpoint_binding(agent_host: str) -> Binding:
    """The binding ``agent_host`` (one of ``AGENT_HOSTS``) asks for in this process."""
    if agent_host == "loopback":
        return Binding()
    from distributed import get_worker

    try:
        worker = get_worker()
    except ValueError:  # not in a Dask worker: there is no worker address to take
        return Binding()
    return worker_binding(worker.address, worker.security)


def worker_binding(address: str, security: Security) -> Binding:
    """A binding on the host of the Dask worker ``address``; HTTPS with ``security``'s
    worker certificate and key when that address speaks TLS."""
    from distributed.comm import get_address_host, parse_address

    host = get_address_host(address)
    if parse_address(address)[0] != "tls":
        return Binding(host)
    context = security.get_listen_args("worker")["ssl_context"]
    context.verify_mode = ssl.CERT_NONE  # agents hold no certificate: their bearer key admits them
    return Binding(host, context, _pem(security.tls_ca_file))


def _pem(ca: str) -> str:
    """The authority's PEM text (Dask's TLS settings hold a file's path or the text itself)."""
    return ca if "\n" in ca else Path(ca).read_text()


def agent_trust(ca_pem: str) -> ssl.SSLContext:
    """``verify`` of an agent's HTTP client to an endpoint over HTTPS: trusts the authority
    ``ca_pem`` alone, without a host-name check, as Dask's own TLS (the run's certificate
    names no host)."""
    context = ssl.create_default_context(cadata=ca_pem)
    context.check_hostname = False
    context.verify_flags &= ~ssl.VERIFY_X509_STRICT  # Dask's certificates lack strict fields
    return context
