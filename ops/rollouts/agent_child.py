"""The agent process: ``python -m rlhfless.ops.rollouts.agent_child <module:function>``.

Started before its shard runs (``agent_process.py`` keeps processes started while the worker
does other work), it imports the agent and ``openai`` and makes the TLS context every
episode's client shares, then serves jobs, one JSON line each on stdin: the endpoint's base
URL and model name, the authority of its HTTPS certificate (``ca_pem``: None over plain
HTTP), the time limit, how many episodes at once, and per episode its bearer key and row. It
runs every episode on a thread with an ``openai.OpenAI`` client of its own and prints one
JSON line per episode as it ends: ``{"i", "reward", "seconds"}`` or ``{"i", "error",
"seconds"}``. An episode over its time limit is reported as an error then and abandoned.
Once every episode is reported it prints ``{"ready": true}`` and waits for the next job (its
imports and warm client kept), unless an episode was abandoned: then it exits
(``os._exit``), which ends any thread still running. It exits when stdin closes (its worker
is gone). The agent is called as ``agent(client, row, model)`` and returns its reward, a
finite number; a module's state lasts from one job to the next, as in a service.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import ssl
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .agent_binding import agent_trust


def _load(spec: str):
    """The agent function, ``openai``, ``httpx`` and a TLS context; or the error that stops
    every episode."""
    try:
        module, _, name = spec.partition(":")
        agent = getattr(importlib.import_module(module), name)
        import httpx
        import openai

        # one context for every client: making one loads the CA bundle (~20 ms of CPU each)
        tls = ssl.create_default_context()
        _warm(openai, httpx)
        httpx.Client(verify=tls).close()  # the first client's transport: ~15 ms of CPU
        return agent, openai, httpx, tls
    except BaseException as err:
        return f"agent {spec!r} cannot be loaded: {type(err).__name__}: {err}"


def _warm(openai, httpx) -> None:
    """One whole chat request, answered in-process: a process's first request builds the
    client's request and response types (~10 ms of CPU), which would hold up its first
    episode."""
    answer = {"id": "-", "object": "chat.completion", "created": 0, "model": "-",
              "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                           "message": {"role": "assistant", "content": "-"}}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=answer))
    client = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="-", max_retries=0,
                           http_client=httpx.Client(transport=transport))
    reply = client.chat.completions.create(model="-", max_tokens=1,
                                           messages=[{"role": "user", "content": "-"}])
    reply.choices[0].message.model_dump(exclude_none=True)


def run_job(job: dict, loaded) -> bool:
    """Every episode of ``job``, one JSON line each as it ends; whether every episode's
    thread has finished (none abandoned over its limit, so the process may take another)."""
    lock, reported, started, all_reported = threading.Lock(), set(), {}, threading.Event()
    abandoned = []

    def report(i: int, **out) -> None:
        with lock:
            if i in reported:
                return
            reported.add(i)
            seconds = time.monotonic() - started.get(i, time.monotonic())
            print(json.dumps({"i": i, **out, "seconds": seconds}), flush=True)
            if len(reported) == len(job["episodes"]):
                all_reported.set()

    if isinstance(loaded, str):  # every episode fails alike: said once per episode
        for i in range(len(job["episodes"])):
            report(i, error=loaded)
        return False
    agent, openai, httpx, tls = loaded
    tls = agent_trust(job["ca_pem"]) if job["ca_pem"] else tls  # HTTPS: the run's CA alone

    def one(i: int, episode: dict) -> None:
        started[i] = time.monotonic()
        client = openai.OpenAI(base_url=job["base_url"], api_key=episode["api_key"],
                               max_retries=0, timeout=job["timeout_s"],
                               http_client=httpx.Client(verify=tls))
        try:
            reward = agent(client, episode["row"], job["model"])
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) \
                    or not math.isfinite(float(reward)):
                raise TypeError(f"the agent returned {reward!r}, not a finite number")
            report(i, reward=float(reward))
        except BaseException as err:  # the agent's own failure: this episode only
            report(i, error=f"{type(err).__name__}: {' '.join(str(err).split())[:300]}")

    pool = ThreadPoolExecutor(max(1, job["concurrency"]), thread_name_prefix="agent")
    for i, episode in enumerate(job["episodes"]):
        pool.submit(one, i, episode)
    while not all_reported.wait(0.05):
        now = time.monotonic()
        for i, t in list(started.items()):
            if now - t > job["timeout_s"] and i not in reported:
                abandoned.append(i)
                report(i, error=f"TimeoutError: the episode ran over {job['timeout_s']:g} s")
    pool.shutdown(wait=not abandoned)
    return not abandoned


def main() -> None:
    loaded = _load(sys.argv[1])
    for line in sys.stdin:  # one job per line, until the worker closes stdin
        if not line.strip():
            continue
        if not run_job(json.loads(line), loaded):
            break  # threads left running: ended with the process
        print(json.dumps({"ready": True}), flush=True)  # free for the next job
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
