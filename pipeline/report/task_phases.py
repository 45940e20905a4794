"""The phases inside tasks (``ops/engine/phases.py``), from the workers to the run's trace.

On each worker process the sink of the engines' phases files a phase under the task its
thread runs (Dask's ``thread_state``) as ``[name, seconds from the task's start, seconds
long, args]``, at most ``MAX_TASK_PHASES`` a task (more are counted, not kept). When the
task ends, ``PhaseShipper`` (a worker plugin) sends them to the scheduler as one event
(``Worker.log_event``, topic ``TOPIC``), where ``PhaseLog`` (a scheduler plugin) keeps them by
task key until the driver drains them (``drain``). Offsets from the task's start, not
times: the trace places them inside the task's span, wherever Dask's correction of the
worker's clock put it. The event goes on the worker's ordered stream before the task's
result, so a finished task's phases are on the scheduler when its record is.
"""

from __future__ import annotations

from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin
from distributed.worker import thread_state

from rlhfless.ops.engine.phases import set_sink

TOPIC = "rlhfless-phases"
MAX_TASK_PHASES = 1000  # a task of a 0.5 s decode span each: over 8 minutes of decoding
RUNNING = frozenset({"executing", "long-running", "cancelled", "resumed"})

_filed: dict[str, dict] = {}  # task key -> {"phases": [...], "dropped": n}, this process


def file_phase(name: str, t0: float, t1: float, args: dict) -> None:
    """The sink: the phase under the task this thread runs (none: not kept)."""
    key = getattr(thread_state, "key", None)
    if key is None:
        return
    task = _filed.setdefault(str(key), {"phases": [], "dropped": 0})
    if len(task["phases"]) < MAX_TASK_PHASES:
        task["phases"].append([name, t0 - thread_state.start_time, t1 - t0, args])
    else:
        task["dropped"] += 1


class PhaseShipper(WorkerPlugin):
    """Sets the sink at setup; sends a task's phases when it ends (dropped if it did not)."""

    name = "rlhfless-phase-shipper"

    def setup(self, worker) -> None:
        self.worker = worker
        set_sink(file_phase)

    def transition(self, key, start, finish, **kwargs) -> None:
        if finish in RUNNING:
            return
        task = _filed.pop(str(key), None)
        if task is not None and finish in ("memory", "error"):
            self.worker.log_event(TOPIC, {"key": str(key), **task})


class PhaseLog(SchedulerPlugin):
    """The phases of finished tasks by key, until drained."""

    name = "rlhfless-phase-log"

    def __init__(self) -> None:
        self.tasks: dict[str, dict] = {}

    def log_event(self, topic: str, msg) -> None:
        if topic == TOPIC:
            self.tasks[msg["key"]] = msg


def install(client) -> None:
    """Both plugins on ``client``'s cluster (workers started later get the shipper too)."""
    client.register_plugin(PhaseLog())
    client.register_plugin(PhaseShipper())


def drain(dask_scheduler) -> dict[str, dict]:
    """For ``client.run_on_scheduler``: the phases logged since the last drain, by key."""
    log = dask_scheduler.plugins[PhaseLog.name]
    tasks, log.tasks = log.tasks, {}
    return tasks
