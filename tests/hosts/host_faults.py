"""Faults struck from inside a worker, at a chosen point of one of its tasks.

``HostFault`` is a Dask ``WorkerPlugin`` registered on every worker; on the one it names,
when a task whose key starts with ``prefix`` starts executing, it waits for that task's first
decode step (the worker's progress beats advance: ``ops/engine/progress.py``), so that the
fault lands mid-decode (``mid_decode = False``: at once, for a task that does not decode,
such as the trainer's update), and then:

* ``"cut"``: runs the network's cut command for its host (``Network.cut_command``, the
  bridge port set down: packets dropped, no connection closed) and leaves it cut;
* ``"blip"``: the same, and the restore command ``seconds`` later;
* ``"kill"``: SIGKILLs its process group, the nanny and the worker: the host powers off.

A ``prefix`` ``"fetch-N"`` strikes instead as the worker (a trainer, ``weight_store =
"cluster"``) answers the first fetch of policy version N: the request has arrived, and the
reply goes out on the link just cut (``pipeline/tasks/weight_store.py``'s handler, wrapped).
``TaskErrors`` records when a worker's task fails (a fetch that gave up, say).

Each strike appends one JSON line to ``record`` (the time, the worker, the key, the action)
before it acts, so the test knows when the fault began. The plugin travels to the workers
by value (``cloudpickle.register_pickle_by_value``): the workers do not import the tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import cloudpickle
from distributed.diagnostics.plugin import WorkerPlugin

from rlhfless.ops.engine.progress import beats

DECODE_WAIT_S = 30.0  # for the task's first decode step (engine load and prefill come first)
ACTIONS = ("cut", "blip", "kill")
FETCH = "fetch-"  # a prefix "fetch-N": as the worker answers the first fetch of version N


class HostFault(WorkerPlugin):
    """See the module docstring; ``name`` makes one plugin per (worker, prefix)."""

    def __init__(self, worker: str, prefix: str, action: str, record: Path,
                 cut: list[str] = (), restore: list[str] = (), seconds: float = 0.0,
                 mid_decode: bool = True) -> None:
        if action not in ACTIONS:
            raise ValueError(f"fault {action!r}: choose one of {ACTIONS}")
        self.worker_name, self.prefix, self.action = worker, prefix, action
        self.record, self.cut, self.restore, self.seconds = record, cut, restore, seconds
        self.mid_decode = mid_decode
        self.name = f"host-fault-{worker}-{prefix}"

    def setup(self, worker) -> None:
        self.armed = str(worker.name) == self.worker_name
        if self.armed and self.prefix.startswith(FETCH):
            from rlhfless.pipeline.tasks import weight_store

            serve = weight_store.serve_version  # what publish_version makes the handler

            def serving(version: int) -> dict:
                if self.armed and self.prefix == f"{FETCH}{version}":
                    self.armed = False
                    self._strike(self.prefix, beats())
                return serve(version)
            weight_store.serve_version = serving

    def transition(self, key, start: str, finish: str, **kwargs) -> None:
        if self.armed and finish == "executing" and str(key).startswith(self.prefix):
            self.armed = False
            threading.Thread(target=self._strike, args=(str(key), beats()), daemon=True).start()

    def _strike(self, key: str, beats_before: int) -> None:
        give_up = time.monotonic() + (DECODE_WAIT_S if self.mid_decode else 0.0)
        while beats() == beats_before and time.monotonic() < give_up:
            time.sleep(0.001)
        line = {"time": time.time(), "worker": self.worker_name, "key": key,
                "action": self.action, "decoding": beats() != beats_before}
        with open(self.record, "a") as out:
            out.write(json.dumps(line) + "\n")
        if self.action == "kill":
            os.killpg(os.getpgid(0), signal.SIGKILL)
        subprocess.run(self.cut, check=True)
        if self.action == "blip":
            time.sleep(self.seconds)
            subprocess.run(self.restore, check=True)


class TaskErrors(WorkerPlugin):
    """Appends ``{"time", "worker", "key"}`` to ``record`` as a task of a worker fails."""

    name = "task-errors"

    def __init__(self, record: Path) -> None:
        self.record = record

    def setup(self, worker) -> None:
        self.worker_name = str(worker.name)

    def transition(self, key, start: str, finish: str, **kwargs) -> None:
        if finish == "error":
            with open(self.record, "a") as out:
                out.write(json.dumps({"time": time.time(), "worker": self.worker_name,
                                      "key": str(key)}) + "\n")


def read_strikes(record: Path) -> list[dict]:
    """The lines of a record (strikes, errors) so far, in order."""
    if not record.exists():
        return []
    return [json.loads(line) for line in record.read_text().splitlines()]


cloudpickle.register_pickle_by_value(__import__(__name__))
