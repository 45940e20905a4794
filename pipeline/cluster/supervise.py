"""Supervision of a run's workers: a stalled task is a lost worker, a failed task is told once.

``supervise(pc, factor, floor_s, ttl_s)`` installs, on the run's cluster:

* ``StallWatch`` (scheduler plugin): every ``CHECK_S`` it looks at each decoding task
  (stages ``WATCHED``: a chunk, a resumed, adopted or moved tail) that its worker's last
  heartbeat said was executing (not one queued behind another task on that worker: the
  beats of the task before it are not its progress, nor is the wait its stall). Its
  progress clock is the later of when it was first seen processing and when its worker's
  beat count last changed (decode steps, ``ops/engine/progress.py``, reported with the worker's
  heartbeats); a task is watched from its first beat on (its engine load and prefill are
  not: under load they went tens of seconds without a heartbeat reaching the scheduler).
  Beats counted since the check before a task was first seen executing are its own: a
  task shorter than a check (or stopped within one) is watched too. At worst they were the
  last of the task before it on that worker; then the new one's load and prefill, a part
  of its predicted duration, are watched, well within the deadline.
  A task whose clock is older than
  ``stall_timeout_factor`` x its predicted duration (Dask's running mean of its stage's
  durations; 0 before one finished) + ``min_stall_s`` has a stalled worker: a
  stopped (SIGSTOP) or hung process. Its nanny kills and restarts it, exactly as after a
  SIGKILL: Dask runs the lost tasks again elsewhere (generation rows are keyed by (seed,
  iteration, prompt, sample), so every sample is still drawn once and the same). A task
  that keeps beating is never stopped, however much longer than predicted it takes. The
  trainer's tasks do not beat yet (a model load or a checkpoint may take minutes without a
  decode step), so they are not watched. A worker whose heartbeats stopped (a SIGSTOP
  stops them with everything else; so does a host whose link is cut) is removed from the
  scheduler once its silence passes the deadline of the decoding task it was given, or
  ``min_stall_s`` whatever it holds (a silent worker holding finished results would hold
  up the driver as surely), and at ``worker_ttl_s`` (Dask's worker TTL, which the run sets
  to it) whatever its task's deadline (its silence not counting the time this event loop
  was held up, when heartbeats that arrived were not read: the driver's process runs the
  scheduler), checked every ``CHECK_S`` where Dask checks every
  TTL and then waits on the nanny of a host that may not answer: its tasks and
  results are computed again elsewhere at once, and its nanny is then told to kill and
  restart it (a stopped process comes back; the nanny of a host cut off cannot be
  reached, and waiting ``RESTART_WAIT_S`` for it held the iteration that much longer).
* ``WorkerHooks`` (worker plugin, on every worker, restarted ones too): the beat metric, and
  Dask's "Compute Failed" log block silenced: every failed task reaches the driver, which
  either recovers from it or ends the run in one line (``cli.py``; ``--debug`` shows the
  traceback).

``dask_bounds(worker_ttl_s, connect_timeout_s)`` is the Dask config the run sets in the
driver (its scheduler, client and local workers) and ``dask_environment`` the same as the
variables every worker starts with (``Pool.env``; a worker on another host reads it only
there): the worker TTL, every process's comm timeouts (a connection that does not open,
or an open one whose peer stops acknowledging, fails after ``connect_timeout_s``), and no
memory pause.

``drain_stalls(pc)`` hands the driver the records of the workers restarted since the last
call (the loop writes them to metrics.jsonl as ``event = "stall"`` and says one line each).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from distributed.core import rpc
from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin
from distributed.metrics import time  # the clock of the scheduler's last_seen
from tornado.ioloop import PeriodicCallback

from rlhfless.ops.engine.progress import BEATS_METRIC, beats

from ..task_keys import stage_of

CHECK_S = 1.0  # how often the scheduler looks for stalled tasks
RESTART_WAIT_S = 30.0  # for a nanny to kill its stalled worker (it waits 4 s, then SIGKILL)
WATCHED = {"generate", "resume", "continue", "adopt"}  # stages that decode (and beat)


class StallWatch(SchedulerPlugin):
    """Restart the worker of a task that made no progress past its deadline."""

    name = "rlhfless-stall-watch"

    def __init__(self, factor: float, floor_s: float, ttl_s: float) -> None:
        self.factor, self.floor_s, self.ttl_s = factor, floor_s, ttl_s

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        # (worker, key) -> (first seen, the worker's beats then)
        self.seen: dict[tuple[str, object], tuple[float, int | None]] = {}
        self.moved: dict[str, tuple[int, float]] = {}  # worker -> (beats, when they changed)
        self.restarting: set[str] = set()
        self.records: list[dict] = []
        self.last_check = time()
        self.holds: list[tuple[float, float]] = []  # (when, seconds) this loop was held up
        self.callback = PeriodicCallback(self.check, CHECK_S * 1000)
        scheduler.periodic_callbacks[self.name] = self.callback
        self.callback.start()

    def deadline_s(self, ts) -> float:
        return self.factor * max(ts.prefix.duration_average, 0.0) + self.floor_s

    def check(self) -> None:
        now, live = time(), set()
        gap, self.last_check = now - self.last_check - CHECK_S, now
        if gap > CHECK_S:  # this event loop was held up: time not watched is no evidence
            self.seen = {k: (t + gap, b) for k, (t, b) in self.seen.items()}
            self.moved = {a: (c, t + gap) for a, (c, t) in self.moved.items()}
            self.holds.append((now, gap))  # nor silence: heartbeats were not read
        oldest = min((ws.last_seen for ws in self.scheduler.workers.values()), default=now)
        self.holds = [(t, g) for t, g in self.holds if t > oldest]
        for address, ws in self.scheduler.workers.items():
            count = ws.metrics.get(BEATS_METRIC)
            before = self.moved.get(address, (count,))[0]  # the count at the last check
            if count is not None and (address not in self.moved or before != count):
                self.moved[address] = (count, now)  # first seen, or moved since
            for ts in ws.executing:  # as of its last heartbeat, which also sent the beats
                if ts.processing_on is not ws or stage_of(ts.key) not in WATCHED:
                    continue
                live.add((address, ts.key))
                first, beats_then = self.seen.setdefault((address, ts.key), (now, before))
                if count == beats_then:  # not decoding yet (engine load, prefill)
                    continue
                since = max(first, self.moved[address][1])
                deadline = self.deadline_s(ts)
                if now - since > deadline and address not in self.restarting:
                    self.restarting.add(address)
                    self.records.append({
                        "time": now, "worker": str(ws.name), "key": str(ts.key),
                        "no_progress_s": now - since, "deadline_s": deadline,
                        "predicted_s": max(ts.prefix.duration_average, 0.0)})
                    asyncio.ensure_future(self.restart(address))
            self._check_silence(now, address, ws)
        self.seen = {k: t for k, t in self.seen.items() if k in live}
        self.moved = {a: m for a, m in self.moved.items() if a in self.scheduler.workers}

    def _check_silence(self, now: float, address: str, ws) -> None:
        """A worker that sent no heartbeat past the deadline of a decoding task it was given
        (or past ``floor_s``, whatever it holds; past ``ttl_s`` whatever its task's) is
        stopped, hung or cut off: removed, its task and its results computed again
        elsewhere, and restarted where its nanny answers. Its beats cannot tell: none
        arrive."""
        silent = now - ws.last_seen - sum(min(g, t - ws.last_seen) for t, g in self.holds
                                          if t > ws.last_seen)
        if silent <= self.floor_s or address in self.restarting:
            return
        tasks = [ts for ts in ws.processing if stage_of(ts.key) in WATCHED]
        deadline = min(max((self.deadline_s(ts) for ts in tasks), default=self.floor_s),
                       self.ttl_s)
        if silent <= deadline:
            return
        self.restarting.add(address)
        ts = max(tasks, key=self.deadline_s) if tasks else None
        self.records.append({
            "time": now, "worker": str(ws.name), "key": str(ts.key) if ts else "",
            "no_progress_s": silent, "deadline_s": deadline, "no_heartbeat": True,
            "predicted_s": max(ts.prefix.duration_average, 0.0) if ts else 0.0})
        asyncio.ensure_future(self.remove_silent(address, ws.nanny))

    async def restart(self, address: str) -> None:
        """Kill the worker through its nanny, which starts it again (no nanny: removed)."""
        try:
            await self.scheduler.restart_workers(
                [address], timeout=RESTART_WAIT_S, wait_for_workers=False,
                on_error="return", stimulus_id=f"stalled-{time()}")
        finally:
            self.restarting.discard(address)

    async def remove_silent(self, address: str, nanny: str | None) -> None:
        """Remove a silent worker now (its tasks run again elsewhere), then have its nanny,
        if it answers within ``RESTART_WAIT_S``, kill the process, which it restarts."""
        try:
            await self.scheduler.remove_worker(address, stimulus_id=f"silent-{time()}")
            if nanny is not None:
                async with rpc(nanny, connection_args=self.scheduler.connection_args) as n:
                    await asyncio.wait_for(n.kill(reason="silent"), RESTART_WAIT_S)
        except (OSError, asyncio.TimeoutError):
            pass  # unreachable (a host cut off): it is out of the cluster all the same
        finally:
            self.restarting.discard(address)


def _drain(dask_scheduler) -> list[dict]:
    watch = dask_scheduler.plugins[StallWatch.name]
    records, watch.records = watch.records, []
    return records


def _quiet(record: logging.LogRecord) -> bool:
    """Not Dask's "Compute Failed" block (the driver tells the failure), nor a nanny's
    warning that it killed a worker (the restarts here are recorded; at the end of a run,
    and after a failure, a worker still busy is killed as it should be)."""
    return not str(record.msg).startswith(("Compute Failed", "Worker process still alive"))


class WorkerHooks(WorkerPlugin):
    """The beat metric, and no "Compute Failed" block in the worker's log."""

    name = "rlhfless-worker-hooks"

    def setup(self, worker) -> None:
        worker.metrics[BEATS_METRIC] = beats
        logging.getLogger("distributed.worker").addFilter(_quiet)


def supervise(pc, factor: float, floor_s: float, ttl_s: float) -> None:
    """Install ``StallWatch`` and ``WorkerHooks`` on the cluster of ``pc`` (a PoolCluster)."""
    logging.getLogger("distributed.nanny").addFilter(_quiet)  # local nannies: this process
    pc.client.register_plugin(WorkerHooks())
    pc.client.register_plugin(StallWatch(factor, floor_s, ttl_s))


def dask_bounds(worker_ttl_s: float, connect_timeout_s: float) -> dict[str, str | bool]:
    """Dask's config of a run's bounds on a silent host: the scheduler's worker TTL, and
    how long a connection may take to open (``connect``) or, open, go unacknowledged
    (``tcp``: the socket's TCP_USER_TIMEOUT and keepalive) before it fails. And no worker
    pauses at a share of its memory limit: a paused worker starts no task and, an engine's
    memory being none of Dask's data to spill, never resumes (a LoRA run on vLLM's CPU
    build waited for ever so, its workers held at Dask's 80 %); one past the limit's
    terminate share is still restarted by its nanny, its tasks run again."""
    return {"distributed.scheduler.worker-ttl": f"{worker_ttl_s:g}s",
            "distributed.comm.timeouts.connect": f"{connect_timeout_s:g}s",
            "distributed.comm.timeouts.tcp": f"{connect_timeout_s:g}s",
            "distributed.worker.memory.pause": False}


def dask_environment(config: Mapping[str, str | bool]) -> dict[str, str]:
    """``config`` (dotted Dask keys) as the ``DASK_*`` variables a new process reads."""
    return {"DASK_" + key.upper().replace(".", "__").replace("-", "_"): str(value)
            for key, value in config.items()}


def drain_stalls(pc) -> list[dict]:
    """The records of the workers restarted as stalled since the last call."""
    return pc.client.run_on_scheduler(_drain)
