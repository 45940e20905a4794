"""Agent processes: a shard's agent episodes run in child processes (``agent_child.py``).

``run_in_processes`` spreads a shard's episodes over ``processes`` children, contiguous
runs of them each, every child running its episodes on threads, ``concurrency`` at once
over all of them (so an agent's Python, the openai client's ~2 ms of CPU per request among
it, runs on as many cores as there are children: with one, a wave of 16 first requests left
the process one GIL apart while the engine waited for the last). Each child is started
before the first shard that needs it, so its imports are done, and is given each job on a
line of its stdin; it reports one JSON line per episode on stdout. A child that finished
every episode of its job waits for the next shard's (``SPARES``); one that abandoned an
episode over its limit exits, and one that does not report in time is killed, and a new
one is started in its place when the shard ends.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO


@dataclass
class AgentProcess:
    """A started ``agent_child`` process of one agent, waiting for its job on stdin."""

    agent: str
    proc: subprocess.Popen
    stderr: IO[bytes]

    @classmethod
    def start(cls, agent: str) -> AgentProcess:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        stderr = tempfile.TemporaryFile()
        proc = subprocess.Popen([sys.executable, "-m", "rlhfless.ops.rollouts.agent_child",
                                 agent], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=stderr, env=env)
        return cls(agent, proc, stderr)

    def close(self) -> str:
        """Kill it; the end of what it wrote on stderr."""
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):  # stdin's unsent bytes go nowhere
                pipe.close()
        self.stderr.seek(0)
        said = " ".join(self.stderr.read().decode(errors="replace").split())[-300:]
        self.stderr.close()
        return said


# The processes the next shard's episodes run in: those of the last shard that finished their
# job, and new ones started when it ended, whose imports (``openai``, the agent's module:
# about a second of CPU) overlap the worker's other work.
SPARES: list[AgentProcess] = []


def take_process(agent: str) -> AgentProcess:
    """A process for ``agent``'s episodes: a spare if one is of that agent and alive."""
    while SPARES:
        spare = SPARES.pop()
        if spare.agent == agent and spare.proc.poll() is None:
            return spare
        spare.close()
    return AgentProcess.start(agent)


@atexit.register
def close_spares() -> None:
    while SPARES:
        SPARES.pop().close()


def run_in_processes(agent: str, shared: dict, episodes: list[dict], concurrency: int,
                     processes: int, ended: Callable[[int], None]) -> list[dict]:
    """Every episode's outcome (``{"reward"}`` or ``{"error"}``, with ``"seconds"``) from
    ``processes`` agent processes (fewer for fewer episodes); ``ended(i)`` as episode ``i``
    is reported. ``shared``: the job's keys every process gets (base URL, model, ...)."""
    if not episodes:
        return []
    k = min(processes, len(episodes))
    bounds = [round(j * len(episodes) / k) for j in range(k + 1)]
    at_once = math.ceil(concurrency / k)
    outcomes: dict[int, dict] = {}
    ready: list[AgentProcess] = []

    def run(child: AgentProcess, first: int, mine: list[dict]) -> None:
        waves = math.ceil(len(mine) / at_once)
        job = shared | {"concurrency": at_once, "episodes": mine}

        def read() -> None:
            for line in child.proc.stdout:
                out = json.loads(line)
                if out.get("ready"):  # every episode's thread finished: free for another job
                    ready.append(child)
                    return
                i = first + out.pop("i")
                outcomes[i] = out
                ended(i)

        with contextlib.suppress(BrokenPipeError):  # a process that died: said below
            child.proc.stdin.write(json.dumps(job).encode() + b"\n")
            child.proc.stdin.flush()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(shared["timeout_s"] * waves + 30.0)  # every episode within its limit

    children = [take_process(agent) for _ in range(k)]
    runners = [threading.Thread(target=run, args=(child, lo, episodes[lo:hi]), daemon=True)
               for child, lo, hi in zip(children, bounds, bounds[1:])]
    said = []
    try:
        for runner in runners:
            runner.start()
        for runner in runners:
            runner.join()
    finally:
        close_spares()  # those this shard did not take: k wait for the next one
        for child in children:
            if any(child is r for r in ready) and child.proc.poll() is None:
                SPARES.append(child)  # its imports done, its threads finished
            else:
                said.append(child.close())
        SPARES.extend(AgentProcess.start(agent) for _ in range(k - len(SPARES)))
    missing = {"error": "the agent process ended without this episode's result "
                        f"({' '.join(s for s in said if s)})", "seconds": 0.0}
    return [outcomes.get(i, missing) for i in range(len(episodes))]
