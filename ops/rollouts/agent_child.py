"""The agent process: ``python -m rlhfless.ops.rollouts.agent_child``, started per shard.

Reads one JSON job on stdin (the agent ``module:function``, the endpoint's base URL and
model name, the time limit, how many episodes at once, and per episode its bearer key and
row), runs every episode on a thread with an ``openai.OpenAI`` client of its own, and
prints one JSON line per episode as it ends: ``{"i", "reward", "seconds"}`` or
``{"i", "error", "seconds"}``. An episode over its time limit is reported as an error then
and abandoned; the process exits (``os._exit``) once every episode is reported, which ends
any thread still running. The agent is called as ``agent(client, row, model)`` and returns
its reward, a finite number.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor


def _agent(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def main() -> None:
    job = json.loads(sys.stdin.read())
    lock, reported, started = threading.Lock(), set(), {}

    def report(i: int, **out) -> None:
        with lock:
            if i in reported:
                return
            reported.add(i)
            seconds = time.monotonic() - started.get(i, time.monotonic())
            print(json.dumps({"i": i, **out, "seconds": seconds}), flush=True)

    try:
        agent = _agent(job["agent"])
        import openai
    except BaseException as err:  # every episode fails alike: said once per episode
        for i in range(len(job["episodes"])):
            report(i, error=f"agent {job['agent']!r} cannot be loaded: "
                            f"{type(err).__name__}: {err}")
        os._exit(0)

    def one(i: int, episode: dict) -> None:
        started[i] = time.monotonic()
        client = openai.OpenAI(base_url=job["base_url"], api_key=episode["api_key"],
                               max_retries=0, timeout=job["timeout_s"])
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
    while len(reported) < len(job["episodes"]):
        now = time.monotonic()
        for i, t in list(started.items()):
            if now - t > job["timeout_s"]:
                report(i, error=f"TimeoutError: the episode ran over {job['timeout_s']:g} s")
        time.sleep(0.05)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
