"""The scheduler-side half of elasticity: each pool's target, the retirement veto, events.

``ElasticityPlugin`` runs inside the Dask scheduler. It holds the worker count the elastic
policy wants for each pool (``set_pool_target``, from the driver, where the policy has the
batch's predicted lengths; between the driver's decisions, from the queued work: below)
and answers the cluster's ``PoolAdaptive`` (``adaptive.py``)
through two scheduler handlers it installs at start:

* ``elastic_target(pool)``: the pool's target, or None when none was set;
* ``elastic_workers_to_close(pool, n)``: up to ``n`` workers of the pool that may close now:
  the ones the policy named, else the idlest; every plugin's ``valid_workers_downscaling``
  filters them.

A ``SchedulerPlugin`` cannot start or stop workers; the cluster object does, through Dask's
own ``Adaptive`` machinery, which reads the target from here.

``valid_workers_downscaling`` is Dask's own hook for "may these workers be retired?", called
by ``Scheduler.workers_to_close`` (hence by ``Adaptive`` on any SpecCluster, dask-jobqueue's
included) and by ``elastic_workers_to_close``. A worker is kept while it runs a task or while
a waiting task is pinned to it (a continuation that resumes from the KV cache the worker
holds, or a task that needs its warm engine).

It also records, as plain tuples the driver drains (``drain``), worker arrivals and
departures (scheduler clock) with the worker's name and resources: the cost ledger's input.

**Queued work.** Every generation task declares its predicted work as a Dask annotation
(``generation_work``, the one helper every submit site uses: the static graph, the elastic
controller, the async batches): units never split between workers, each with predicted
response tokens, longest sequence and prompt tokens (``ScalingPolicy.predict_work``). The
``transition`` hook keeps the annotated tasks that are waiting, queued or processing; a
task leaving for memory, erred, released or forgotten drops out. Each pool's queue is kept
as tasks come and go (``QueuedWork``: its units in arrival order, a count of tasks per set of
pinned workers), never rescanned, so a transition costs the same however long the queue
(but for an arrival's plan, which reads every queued unit). Once the driver has
installed a pool's sizing rule (``install_sizing``: ``ScalingPolicy.sizing``, a snapshot of
the policy), the pool's target follows that queue:

* work arriving raises the target to the rule's plan of everything queued, never above the
  workers the queued tasks can use: those they are pinned to, plus one per task free to
  run anywhere. Work free to run anywhere (the static graph's generate tasks, an
  evaluation) grows the pool without the driver; the elastic controller pins its chunks
  to the workers its own plan of the batch started, so there the rule only confirms it;
* a drained queue lowers it to what the rule keeps through the predicted idle gap (the
  policy's keep-alive), once the queue has stayed drained ``SETTLE_S`` (the driver submits
  a paused tail's continuation within milliseconds of its chunk's end, and the next batch
  of an async run as soon as the last is generated); the veto still holds every busy or
  pinned worker. A queue drained only in part lowers nothing: a worker idle in the middle
  of a batch is the elastic controller's to release, as it places the tails.

Each change, and each drained queue that keeps the pool, is a record
(``drain_target_changes``) the driver writes to ``decisions.jsonl``;
a target the driver sets (``set_pool_target``) overrides the rule's until the queue moves.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import dask
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.diagnostics.task_stream import TaskStreamPlugin

if TYPE_CHECKING:
    from ..scaling_policy import PoolSizing

PLUGIN_NAME = "rlhfless-elasticity"
WORK = "generation_work"  # the annotation of a generation task's predicted work
ACTIVE = frozenset({"waiting", "queued", "processing", "no-worker"})  # queued work's states
UNIT_FIELDS = ("tokens", "longest", "prompt_tokens")  # a unit's predicted work (PoolSizing)
SETTLE_S = 1.0  # a queue stays drained this long before the pool shrinks


def generation_work(tokens: Sequence[float], longest: Sequence[float],
                    prompt_tokens: Sequence[float], pool: str = "gen"):
    """``with generation_work(...):`` around ``client.submit`` or ``delayed`` calls: the
    generation tasks made inside declare their predicted work to the scheduler, one entry
    per unit never split between workers (response tokens of all its sequences, its longest
    sequence, its prompt tokens)."""
    return dask.annotate(**{WORK: {"pool": pool, "tokens": [float(x) for x in tokens],
                                   "longest": [float(x) for x in longest],
                                   "prompt_tokens": [float(x) for x in prompt_tokens]}})


def pool_of(worker_name: str) -> str:
    """The pool of a worker named ``<pool>-<i>``."""
    return str(worker_name).rsplit("-", 1)[0]


class QueuedWork:
    """One pool's queued generation tasks, updated in O(1) as each arrives or leaves: their
    predicted work in arrival order, and how many are pinned to each set of workers (their
    worker restrictions as they arrived: this project sets them at submission)."""

    def __init__(self) -> None:
        self.work: dict[Any, dict] = {}  # key -> predicted work, in arrival order
        self.pinned_to: dict[Any, frozenset[str]] = {}  # key -> the workers it is pinned to
        self.pin_counts: Counter[frozenset[str]] = Counter()  # pinned workers -> tasks
        self._units: list[list[float]] | None = None  # units(), extended as work arrives

    def add(self, key, work: dict, restrictions) -> None:
        pins = frozenset(restrictions or ())
        self.work[key], self.pinned_to[key] = work, pins
        self.pin_counts[pins] += 1
        if self._units is not None:
            for column, field in zip(self._units, UNIT_FIELDS):
                column.extend(work[field])

    def remove(self, key) -> None:
        del self.work[key]
        pins = self.pinned_to.pop(key)
        self.pin_counts[pins] -= 1
        if not self.pin_counts[pins]:
            del self.pin_counts[pins]
        self._units = None  # rebuilt by the next plan, once however many left

    def units(self) -> list[list[float]]:
        """The queued units' predicted (tokens, longest, prompt_tokens) in arrival order:
        ``PoolSizing.target``'s input (read only)."""
        if self._units is None:
            self._units = [[x for w in self.work.values() for x in w[field]]
                           for field in UNIT_FIELDS]
        return self._units

    def capacity(self, members: set[str]) -> tuple[int, int]:
        """(held, room) among the pool's worker addresses ``members``: the workers queued
        tasks are pinned to, and those plus one per task pinned to none of them."""
        held, free = set(), 0
        for pins, tasks in self.pin_counts.items():
            pinned = pins & members
            held |= pinned
            free += 0 if pinned else tasks
        return len(held), len(held) + free


class ElasticityPlugin(SchedulerPlugin):
    name = PLUGIN_NAME

    def __init__(self) -> None:
        self.events: list[tuple] = []  # (kind, t, worker name, details)
        self.targets: dict[str, int] = {}  # pool -> workers the policy wants
        self.to_close: dict[str, list[str]] = {}  # pool -> workers the policy would close
        self._names: dict[str, str] = {}  # address -> worker name (kept after it left)
        self.queues: defaultdict[str, QueuedWork] = defaultdict(QueuedWork)  # by pool
        self.queued_in: dict[Any, str] = {}  # key of a queued generation task -> its pool
        self.sizing: dict[str, PoolSizing] = {}  # pool -> the rule that sizes it from its queue
        # pool -> a drained queue's decision (target, reason, since, key), not yet taken
        self.pending: dict[str, tuple[int, str, float, Any]] = {}
        self.changes: list[dict] = []  # the rule's target changes, for the driver
        self.scheduler = None

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers["elastic_target"] = self.target
        scheduler.handlers["elastic_workers_to_close"] = self.workers_to_close

    def add_worker(self, scheduler=None, worker: str | None = None) -> None:
        ws = scheduler.workers[worker]
        self._names[worker] = str(ws.name)
        self.events.append(("arrive", time.time(), str(ws.name), dict(ws.resources)))

    def remove_worker(self, scheduler=None, worker: str | None = None, *, stimulus_id=None,
                      **kwargs) -> None:
        name = self._names.get(worker, worker)  # its tasks still name it (task_records)
        self.events.append(("depart", time.time(), name, {}))

    def drain(self) -> list[tuple]:
        events, self.events = self.events, []
        return events

    # ---- queued work -------------------------------------------------------------------

    def transition(self, key, start: str, finish: str, *args, stimulus_id=None,
                   **kwargs) -> None:
        if finish in ACTIVE:
            if key in self.queued_in:
                return
            ts = self.scheduler.tasks.get(key)
            work = (ts.annotations or {}).get(WORK) if ts is not None else None
            if work is not None:
                pool = self.queued_in[key] = work["pool"]
                self.queues[pool].add(key, work, ts.worker_restrictions)
                self._arrived(pool, key)
        elif key in self.queued_in:
            pool = self.queued_in.pop(key)
            self.queues[pool].remove(key)
            if not self.queues[pool].work:
                self._drained(pool, key)

    def queued(self, pool: str) -> dict[Any, dict]:
        """The predicted work of ``pool``'s queued and running generation tasks, by key."""
        queue = self.queues.get(pool)
        return {} if queue is None else dict(queue.work)

    def _arrived(self, pool: str, key) -> None:
        sizing = self.sizing.get(pool)
        if sizing is None:
            return
        self.pending.pop(pool, None)
        queue = self.queues[pool]
        members = {ws.address for ws in self._members(pool)}
        held, room = queue.capacity(members)
        n, why = sizing.target(*queue.units(), current=len(members), held=held, room=room)
        if n > self.targets.get(pool, len(members)):
            self._change(pool, n, why, key, len(queue.work))

    def _drained(self, pool: str, key) -> None:
        sizing = self.sizing.get(pool)
        if sizing is None:
            return
        n, why = sizing.target([], [], [], current=len(self._members(pool)))
        self.pending[pool] = (n, why, time.time(), key)

    def _change(self, pool: str, n: int, why: str, key, queued: int) -> None:
        before = self.targets.get(pool, len(self._members(pool)))
        self.targets[pool], self.to_close[pool] = int(n), []
        self.changes.append({"t": time.time(), "pool": pool, "kind": "queue_target",
                             "from": before, "to": int(n), "queued_tasks": queued,
                             "reason": why, "key": str(key)})

    def _members(self, pool: str) -> list:
        return [ws for ws in self.scheduler.workers.values() if pool_of(ws.name) == pool]

    def drain_changes(self) -> list[dict]:
        changes, self.changes = self.changes, []
        return changes

    # ---- targets -----------------------------------------------------------------------

    def set_target(self, pool: str, n: int, close: list[str] = ()) -> None:
        """The policy wants ``n`` workers in ``pool``; ``close``: which to close first."""
        self.targets[pool] = int(n)
        self.to_close[pool] = [str(c) for c in close]
        self.pending.pop(pool, None)

    def target(self, pool: str) -> int | None:
        """The pool's target; once a drained queue has stayed drained ``SETTLE_S``, what
        the rule made of it (lower, or kept through the idle gap: a record either way)."""
        pending = self.pending.get(pool)
        if pending is not None and time.time() - pending[2] >= SETTLE_S:
            del self.pending[pool]
            n, why, _, key = pending
            now = self.targets.get(pool, len(self._members(pool)))
            self._change(pool, min(n, now), why, key, 0)
        return self.targets.get(pool)

    def workers_to_close(self, pool: str, n: int) -> list[str]:
        """Up to ``n`` names of ``pool``'s workers that may close now: those the policy named
        (and only those, when it named any), else idle ones holding the least data first;
        every plugin may veto (``valid_workers_downscaling``)."""
        scheduler = self.scheduler
        members = [ws for ws in scheduler.workers.values() if pool_of(ws.name) == pool]
        named = self.to_close.get(pool)
        if named:
            candidates = [ws for ws in members if str(ws.name) in named]
        else:
            candidates = sorted(members, key=lambda ws: (len(ws.processing), ws.nbytes))
        for plugin in scheduler.plugins.values():
            candidates = plugin.valid_workers_downscaling(scheduler, candidates)
        return [str(ws.name) for ws in candidates][: max(int(n), 0)]

    def valid_workers_downscaling(self, scheduler, workers: list) -> list:
        needed = set()
        for ws in workers:
            if ws.processing:
                needed.add(ws.address)
        for ts in scheduler.tasks.values():
            if ts.state in ("waiting", "no-worker", "queued") and ts.worker_restrictions:
                needed.update(ts.worker_restrictions)
        return [ws for ws in workers if ws.address not in needed]


def drain_events(dask_scheduler) -> list[tuple]:
    """For ``client.run_on_scheduler``: the plugin's events since the last drain."""
    return dask_scheduler.plugins[PLUGIN_NAME].drain()


def task_records(dask_scheduler, since: int) -> tuple[list[dict], int]:
    """For ``client.run_on_scheduler``: the task stream's records (Dask's ``task-stream``
    plugin, installed here if absent) from the ``since``-th on, each with ``worker_name``
    (the name of the worker that ran it, also one that has left since), and the index to
    ask from next: by position, so that no record is missed or given twice."""
    stream = dask_scheduler.plugins.get(TaskStreamPlugin.name)
    if stream is None:
        stream = TaskStreamPlugin(dask_scheduler)
        dask_scheduler.add_plugin(stream)
    names = dask_scheduler.plugins[PLUGIN_NAME]._names
    records = [{**r, "worker_name": names.get(r["worker"], r["worker"])}
               for r in stream.collect(start_index=since)]
    return records, stream.index


def set_pool_target(dask_scheduler, pool: str, n: int, close: list[str] = ()) -> None:
    """For ``client.run_on_scheduler``: the policy's target of ``pool``."""
    dask_scheduler.plugins[PLUGIN_NAME].set_target(pool, n, close)


def install_sizing(dask_scheduler, pool: str, sizing: PoolSizing) -> None:
    """For ``client.run_on_scheduler``: from now on ``pool``'s target follows its queued
    work by ``sizing`` (``ScalingPolicy.sizing``)."""
    dask_scheduler.plugins[PLUGIN_NAME].sizing[pool] = sizing


def drain_target_changes(dask_scheduler) -> list[dict]:
    """For ``client.run_on_scheduler``: the target changes the queue made since the last
    drain (records for ``decisions.jsonl``; ``key``: the task whose arrival or departure
    made it)."""
    return dask_scheduler.plugins[PLUGIN_NAME].drain_changes()
