"""Agents outside the worker's process: ``agent = "http://host:port/path"`` (or ``https://``).

The user runs their agent as a service of their own (any language, any container) and the
run POSTs each episode to it, as JSON::

    {"row": {...}, "base_url": "http://127.0.0.1:<port>/v1", "api_key": "<episode key>",
     "model": "rlhfless", "ca_pem": null, "timeout_s": 60.0}

``row`` is the prompt's row (every dataset column, ``prompt_text`` among them), ``base_url``
and ``api_key`` the worker's endpoint and the episode's own key (an OpenAI client takes them
as they are; an Anthropic client takes ``base_url`` without its ``/v1``), ``ca_pem`` the
authority to verify that endpoint with when it speaks HTTPS (``agent_host = "worker"`` on a
TLS cluster; None over plain HTTP). The service plays the episode against the endpoint and
answers ``{"reward": <finite number>}`` (any 2xx status) once it is over; ``{"error":
"..."}``, another status, a body that is no such JSON, a refused connection or no answer
within ``timeout_s`` of the POST ends that episode as an error, never the shard, as an
in-process agent's failure does (``agent_child.py``). Up to ``concurrency`` episodes are in
flight at once. An episode over its limit is reported then and abandoned: its connection is
closed by its own read timeout.

TLS to the service: an ``https://`` URL is verified, its host name checked, against the
authority of the config's ``agent_ca_file`` alone (its PEM text, read by the driver, travels
with the task: ``service_trust``), or without it against the system's authorities as the
worker's environment sets them (OpenSSL's ``SSL_CERT_FILE`` / ``SSL_CERT_DIR``).
"""

from __future__ import annotations

import math
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import httpx

SCHEMES = ("http", "https")


def is_agent_url(agent: str) -> bool:
    """Whether ``agent`` names an agent service (a URL) rather than a Python function."""
    return agent.split("://", 1)[0].lower() in SCHEMES and "://" in agent


def check_agent_url(agent: str) -> None:
    """A ``ValueError`` in one line unless ``agent`` is an http(s) URL with a host."""
    parts = urlsplit(agent)
    try:
        parts.port  # noqa: B018 (a port that is no number raises here)
    except ValueError:
        raise ValueError(f"agent = {agent!r}: its port is not a number") from None
    if parts.scheme.lower() not in SCHEMES or not parts.hostname:
        raise ValueError(f"agent = {agent!r}: an agent service is an http:// or https:// URL "
                         "with a host, e.g. 'http://127.0.0.1:8000/episode'")


def service_trust(ca_pem: str | None) -> ssl.SSLContext:
    """``verify`` of the client to an agent service: the authority ``ca_pem`` alone (an
    ``ssl.SSLError`` or ``ValueError`` when it holds no PEM certificate), or the system's."""
    if ca_pem is None:
        return ssl.create_default_context()
    if "-----BEGIN CERTIFICATE-----" not in ca_pem:
        raise ValueError("no PEM certificate")
    return ssl.create_default_context(cadata=ca_pem)


def post_episodes(url: str, job: dict, episodes: list[dict], concurrency: int,
                  on_end: Callable[[int], None], service_ca: str | None = None) -> list[dict]:
    """Every episode's outcome (``{"reward"}`` or ``{"error"}``, with ``"seconds"``) from the
    service at ``url``: ``job`` holds what every episode's body shares (base URL, model,
    ``ca_pem``, ``timeout_s``), each of ``episodes`` its ``row`` and ``api_key``;
    ``on_end(i)`` is called as soon as episode ``i`` is over; ``service_ca``: the PEM text
    of the only authority the service's certificate may chain to (None: the system's)."""
    import httpx  # here: the config checks an agent's URL without the HTTP client

    timeout_s = float(job["timeout_s"])
    outcomes: dict[int, dict] = {}
    started: dict[int, float] = {}
    lock, all_done = threading.Lock(), threading.Event()

    def report(i: int, **out) -> None:
        with lock:
            if i in outcomes:
                return
            outcomes[i] = out | {"seconds": time.monotonic() - started[i]}
            if len(outcomes) == len(episodes):
                all_done.set()
        on_end(i)

    client = httpx.Client(verify=service_trust(service_ca), timeout=timeout_s,
                          limits=httpx.Limits(max_connections=concurrency))

    overran = f"TimeoutError: the episode ran over {timeout_s:g} s"

    def one(i: int, episode: dict) -> None:
        with lock:
            started[i] = time.monotonic()
        try:
            reply = client.post(url, json=job | episode)
            report(i, **_outcome(reply))
        except httpx.TimeoutException:
            report(i, error=overran)
        except httpx.HTTPError as err:  # refused, reset: this episode only
            report(i, error=f"{type(err).__name__}: {_line(str(err)) or 'no answer'} ({url})")

    pool = ThreadPoolExecutor(concurrency, thread_name_prefix="agent-http")
    try:
        for i, episode in enumerate(episodes):
            pool.submit(one, i, episode)
        while not all_done.wait(0.05):
            now = time.monotonic()
            with lock:
                late = [i for i, t in started.items() if now - t > timeout_s]
            for i in late:
                report(i, error=overran)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        threading.Thread(target=_close_after, args=(pool, client), daemon=True).start()
    return [outcomes[i] for i in range(len(episodes))]


def _close_after(pool: ThreadPoolExecutor, client: httpx.Client) -> None:
    """Close the client once its abandoned requests have ended (their read timeout)."""
    pool.shutdown(wait=True)
    client.close()


def _outcome(reply: httpx.Response) -> dict:
    """``{"reward"}`` or ``{"error"}`` from the service's answer to one episode."""
    try:
        body = reply.json()
    except ValueError:
        body = None
    if not reply.is_success:
        said = body.get("error") if isinstance(body, dict) else None
        return {"error": f"the agent service answered {reply.status_code}: "
                         f"{_line(str(said) if said else reply.text)}"}
    if isinstance(body, dict) and "error" in body:
        return {"error": f"the agent service said: {_line(str(body['error']))}"}
    reward = body.get("reward") if isinstance(body, dict) else None
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) \
            or not math.isfinite(float(reward)):
        return {"error": f"the agent service answered {_line(reply.text)!r}, not "
                         '{"reward": <a finite number>}'}
    return {"reward": float(reward)}


def _line(text: str) -> str:
    return " ".join(text.split())[:300]
