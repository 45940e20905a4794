"""The scheduler plugin's targets, veto and queued work, and PoolAdaptive, against fakes.

As dask's own ``deploy/tests/test_adaptive_core.py`` does: no cluster, no processes. The
plugin runs on a fake scheduler state (workers, tasks with annotations, plugins, handlers;
the scheduler's transitions are the plugin's ``transition`` called by hand);
``PoolAdaptive`` runs Dask's real ``Adaptive`` / ``AdaptiveCore`` logic over a fake cluster
whose scheduler comm dispatches to those handlers. The real-LocalCluster tests are in
``tests/pipeline/train/test_elastic.py``.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

import dask
import pytest

from rlhfless.schedulers.dask import plugin as dask_plugin
from rlhfless.schedulers.dask.adaptive import PoolAdaptive
from rlhfless.schedulers.dask.plugin import (
    ACTIVE,
    WORK,
    ElasticityPlugin,
    generation_work,
    pool_of,
)
from rlhfless.schedulers.scaling_policy import ScalingKnobs, ScalingPolicy
from rlhfless.schedulers.throughput import ThroughputModel


@dataclass(eq=False)
class FakeWorker:
    name: str
    processing: set = field(default_factory=set)
    nbytes: int = 0

    @property
    def address(self) -> str:
        return f"tcp://{self.name}"


@dataclass(eq=False)
class FakeTask:
    state: str
    worker_restrictions: set
    annotations: dict = field(default_factory=dict)


class FakeScheduler:
    def __init__(self, names: list[str]) -> None:
        self.workers = {f"tcp://{n}": FakeWorker(n) for n in names}
        self.tasks: dict[str, FakeTask] = {}
        self.plugins: dict = {}
        self.handlers: dict = {}
        self.retired: list[list[str]] = []

    def worker(self, name: str) -> FakeWorker:
        return self.workers[f"tcp://{name}"]


class FakeComm:
    """What ``Adaptive.scheduler`` (the cluster's scheduler comm) is asked."""

    def __init__(self, scheduler: FakeScheduler) -> None:
        self.s = scheduler

    async def elastic_target(self, pool: str):
        return self.s.handlers["elastic_target"](pool=pool)

    async def elastic_workers_to_close(self, pool: str, n: int):
        return self.s.handlers["elastic_workers_to_close"](pool=pool, n=n)

    async def retire_workers(self, names, remove, close_workers):
        self.s.retired.append(list(names))
        for name in names:
            del self.s.workers[f"tcp://{name}"]


class FakeCluster:
    """A pooled cluster: every planned worker is connected."""

    def __init__(self, scheduler: FakeScheduler) -> None:
        self.scheduler_comm = FakeComm(scheduler)
        self.s = scheduler
        self.scaled: list[tuple[str, int]] = []

    @property
    def plan(self) -> set:
        return {w.name for w in self.s.workers.values()}

    requested = observed = plan

    def scale_pool(self, pool: str, n: int) -> None:
        self.scaled.append((pool, n))
        have = [w for w in self.plan if w.startswith(f"{pool}-")]
        for i in range(len(have), n):
            self.s.workers[f"tcp://{pool}-{i}"] = FakeWorker(f"{pool}-{i}")

    async def scale_down(self, workers) -> None:
        assert not set(workers) & self.plan  # retired on the scheduler first


def _setup(names: list[str]) -> tuple[FakeScheduler, ElasticityPlugin]:
    scheduler = FakeScheduler(names)
    plugin = ElasticityPlugin()
    scheduler.plugins[plugin.name] = plugin
    asyncio.run(plugin.start(scheduler))
    return scheduler, plugin


def test_plugin_holds_targets_and_vetoes_busy_or_pinned_workers():
    s, plugin = _setup(["gen-0", "gen-1", "gen-2", "train-0"])
    assert s.handlers["elastic_target"](pool="gen") is None  # nothing set: no opinion
    plugin.set_target("gen", 1)
    assert s.handlers["elastic_target"](pool="gen") == 1
    s.worker("gen-0").processing.add("generate-1-0")  # running a chunk
    s.tasks["resume-1-2"] = FakeTask("waiting", {"tcp://gen-2"})  # resumes from gen-2's KV
    s.worker("train-0").nbytes = 0
    close = s.handlers["elastic_workers_to_close"]
    assert close(pool="gen", n=2) == ["gen-1"]  # never the trainer, never a vetoed one
    s.worker("gen-0").processing.clear()
    s.worker("gen-0").nbytes = 10
    del s.tasks["resume-1-2"]
    assert close(pool="gen", n=2) == ["gen-1", "gen-2"]  # idle, least data first
    plugin.set_target("gen", 2, close=["gen-0"])  # the policy names which one
    assert close(pool="gen", n=1) == ["gen-0"]
    s.worker("gen-0").processing.add("generate-2-0")
    assert close(pool="gen", n=1) == []  # named but busy: kept, and no other closes instead


def test_adaptive_scales_the_pool_to_the_plugins_target():
    s, plugin = _setup(["gen-0", "train-0"])
    cluster = FakeCluster(s)

    async def run() -> PoolAdaptive:
        adapt = PoolAdaptive(cluster, pool="gen", interval=0, wait_count=1)
        await adapt.adapt()  # no target: the pool stays
        assert not adapt.log and cluster.scaled == []
        plugin.set_target("gen", 3)
        await adapt.adapt()
        assert adapt.log[-1][1] == {"status": "up", "n": 3}
        assert cluster.scaled == [("gen", 3)] and len(adapt.plan) == 3
        assert "train-0" in cluster.plan and "train-0" not in adapt.plan
        plugin.set_target("gen", 1, close=["gen-1", "gen-2"])
        s.worker("gen-2").processing.add("generate-4-2")  # vetoed while it runs
        await adapt.adapt()
        assert adapt.log[-1][1] == {"status": "down", "workers": ["gen-1"]}
        assert s.retired == [["gen-1"]] and adapt.plan == {"gen-0", "gen-2"}
        s.worker("gen-2").processing.clear()
        await adapt.adapt()  # the next step closes it once it is idle
        assert s.retired[-1] == ["gen-2"] and adapt.plan == {"gen-0"}
        return adapt

    adapt = asyncio.run(run())
    assert [entry["status"] for _, entry in adapt.log] == ["up", "down", "down"]


def test_wait_count_damps_a_flapping_target():
    s, plugin = _setup(["gen-0", "gen-1"])
    cluster = FakeCluster(s)

    async def run() -> None:
        adapt = PoolAdaptive(cluster, pool="gen", interval=0, wait_count=2)
        plugin.set_target("gen", 1)
        await adapt.adapt()
        assert s.retired == []  # recommended once: not yet firm
        plugin.set_target("gen", 2)
        await adapt.adapt()  # the target came back: the count resets
        plugin.set_target("gen", 1)
        await adapt.adapt()
        assert s.retired == []
        await adapt.adapt()
        assert len(s.retired) == 1

    asyncio.run(run())


# ---- queued generation work ------------------------------------------------------------


def _sizing(keep_alive_s: float = -1.0, max_workers: int = 4):
    """A policy whose decode steps slow down a lot with the batch (so that spreading a
    batch pays), with a 1 s cold start and 10 s after generation (an idle gap longer than
    the break-even keep-alive)."""
    scaling = ScalingPolicy(ScalingKnobs(keep_alive_s=keep_alive_s),
                           ThroughputModel(step_slope_s=0.01, cold_start_s=1.0))
    scaling.update_seconds = 10.0
    return scaling.sizing(n_samples=4, max_workers=max_workers)


def _arrive(s: FakeScheduler, plugin: ElasticityPlugin, key: str, groups: int,
            pinned: set = frozenset()) -> None:
    """A generation task of ``groups`` prompt groups (4 samples of 500 predicted tokens)
    enters the scheduler."""
    with generation_work([2000.0] * groups, [600.0] * groups, [50.0] * groups):
        work = dask.get_annotations()[WORK]
    s.tasks[key] = FakeTask("waiting", set(pinned), {WORK: work, "resources": {"GEN": 1}})
    plugin.transition(key, "released", "waiting", stimulus_id="test")


def _leave(s: FakeScheduler, plugin: ElasticityPlugin, key: str, finish="memory") -> None:
    plugin.transition(key, "processing", finish, stimulus_id="test")
    s.tasks[key].state = finish


def test_queued_work_raises_the_target_and_a_drained_queue_lowers_it(monkeypatch):
    monkeypatch.setattr(dask_plugin, "SETTLE_S", 0.0)
    s, plugin = _setup(["gen-0", "train-0"])
    _arrive(s, plugin, "generate-1-0", 4)
    assert plugin.target("gen") is None  # no sizing rule installed: only tracked
    assert list(plugin.queued("gen")) == ["generate-1-0"]
    plugin.sizing["gen"] = sizing = _sizing()
    _arrive(s, plugin, "generate-2-0", 4)
    _arrive(s, plugin, "generate-2-1", 4)  # a batch generated ahead
    want, _ = sizing.target([2000.0] * 12, [600.0] * 12, [50.0] * 12, current=1)
    assert want == 4  # the policy's plan of the 12 groups queued ...
    assert plugin.target("gen") == 3  # ... but 3 tasks can use no more than 3 workers
    plugin.transition("generate-2-0", "waiting", "processing", stimulus_id="test")
    _leave(s, plugin, "generate-1-0")
    _leave(s, plugin, "generate-2-0", "erred")
    assert plugin.target("gen") == 3  # drained in part: nothing lowers
    _leave(s, plugin, "generate-2-1", "forgotten")
    assert plugin.queued("gen") == {} and plugin.target("gen") == 0  # gap 10 s > 1 s
    changes = plugin.drain_changes()
    assert [(c["from"], c["to"]) for c in changes] == [(1, 2), (2, 3), (3, 0)]
    assert changes[-1]["key"] == "generate-2-1" and "keep-alive" in changes[-1]["reason"]
    assert plugin.drain_changes() == []


def test_pinned_work_never_asks_for_workers_it_cannot_use(monkeypatch):
    monkeypatch.setattr(dask_plugin, "SETTLE_S", 0.0)
    s, plugin = _setup(["gen-0", "gen-1", "train-0"])
    plugin.sizing["gen"] = _sizing(keep_alive_s=100.0)
    plugin.set_target("gen", 2)  # the driver's plan, its chunks pinned to gen-0 and gen-1
    _arrive(s, plugin, "generate-1-0", 8, pinned={"tcp://gen-0"})
    _arrive(s, plugin, "generate-1-1", 8, pinned={"tcp://gen-1"})
    assert plugin.target("gen") == 2 and plugin.drain_changes() == []
    _leave(s, plugin, "generate-1-0")
    assert plugin.drain_changes() == []
    _leave(s, plugin, "generate-1-1")
    assert plugin.target("gen") == 2  # an idle gap of 10 s < keep-alive 100 s: kept
    (kept,) = plugin.drain_changes()
    assert (kept["from"], kept["to"]) == (2, 2) and "< keep-alive 100.00 s" in kept["reason"]


def test_the_drivers_target_and_new_work_cancel_a_pending_shrink(monkeypatch):
    s, plugin = _setup(["gen-0", "gen-1"])
    plugin.sizing["gen"] = _sizing()
    plugin.set_target("gen", 2)
    _arrive(s, plugin, "generate-1-0", 1)
    _leave(s, plugin, "generate-1-0")
    assert plugin.target("gen") == 2  # drained, but not for SETTLE_S yet
    _arrive(s, plugin, "resume-1-0", 1, pinned={"tcp://gen-0"})  # a paused tail goes on
    monkeypatch.setattr(dask_plugin, "SETTLE_S", 0.0)
    assert plugin.target("gen") == 2
    _leave(s, plugin, "resume-1-0")
    plugin.set_target("gen", 2)  # the driver decided after the queue did
    assert plugin.target("gen") == 2 and plugin.drain_changes() == []  # nothing applied


def test_adaptive_follows_the_queued_work(monkeypatch):
    monkeypatch.setattr(dask_plugin, "SETTLE_S", 0.0)
    s, plugin = _setup(["gen-0", "train-0"])
    cluster = FakeCluster(s)
    plugin.sizing["gen"] = _sizing()

    async def run() -> PoolAdaptive:
        adapt = PoolAdaptive(cluster, pool="gen", interval=0, wait_count=1)
        for i in range(3):
            _arrive(s, plugin, f"generate-1-{i}", 4)
        await adapt.adapt()
        assert adapt.log[-1][1] == {"status": "up", "n": 3} and len(adapt.plan) == 3
        assert set(adapt.requested_at) == {"gen-1", "gen-2"}  # billed from their request
        s.worker("gen-1").processing.add("generate-1-1")
        for i in range(3):
            _leave(s, plugin, f"generate-1-{i}")
        await adapt.adapt()
        assert adapt.plan == {"gen-1"}  # busy (with other work): vetoed
        s.worker("gen-1").processing.clear()
        await adapt.adapt()
        assert adapt.plan == set() and "train-0" in cluster.plan
        return adapt

    adapt = asyncio.run(run())
    assert [entry["status"] for _, entry in adapt.log] == ["up", "down", "down"]


@pytest.mark.parametrize("finish", ["memory", "erred", "released", "forgotten"])
def test_a_task_that_leaves_the_queue_drops_out(finish):
    s, plugin = _setup(["gen-0"])
    _arrive(s, plugin, "generate-1-0", 2)
    plugin.transition("generate-1-0", "waiting", "queued", stimulus_id="test")
    assert list(plugin.queued("gen")) == ["generate-1-0"]
    _leave(s, plugin, "generate-1-0", finish)
    assert plugin.queued("gen") == {}


def _recount(s: FakeScheduler, pool: str) -> tuple[list, list, tuple[int, int]]:
    """From scratch, over every task in the scheduler: ``pool``'s queued generation tasks
    (keys in arrival order), their units, and (held, room) among its current workers."""
    members = {w.address for w in s.workers.values() if pool_of(w.name) == pool}
    queued = [(key, ts) for key, ts in s.tasks.items()
              if ts.state in ACTIVE and ts.annotations.get(WORK, {}).get("pool") == pool]
    held, free = set(), 0
    for _, ts in queued:
        pinned = ts.worker_restrictions & members
        held |= pinned
        free += not pinned
    units = [[x for _, ts in queued for x in ts.annotations[WORK][f]]
             for f in ("tokens", "longest", "prompt_tokens")]
    return [key for key, _ in queued], units, (len(held), len(held) + free)


def test_the_queue_kept_incrementally_matches_a_recount_after_random_transitions():
    """Arrivals (pinned to a member, to a worker gone, to two, or free), moves between active
    states, departures of every kind, returns of tasks that left, workers joining and
    leaving: after each, every pool's queue equals a recount of the scheduler's tasks."""
    rng = random.Random(0)
    s, plugin = _setup(["gen-0", "gen-1", "eval-0"])
    plugin.sizing["gen"] = _sizing()  # the gen pool's arrivals are planned too
    pools, returned, longest = ("gen", "eval"), 0, 0
    for step in range(600):
        active = [k for k, ts in s.tasks.items() if ts.state in ACTIVE]
        gone = [k for k, ts in s.tasks.items() if ts.state not in ACTIVE]
        roll = rng.random()
        if roll < 0.35 or not active:  # a new task, generation work or not
            key, pool = f"t-{step}", rng.choice(pools)
            pins = rng.choice([set(), {f"tcp://{pool}-{rng.randrange(4)}"},
                               {f"tcp://{pool}-0", f"tcp://{pool}-3"}])
            groups = range(rng.randint(1, 3))
            with generation_work([rng.uniform(1, 4000) for _ in groups],
                                 [rng.uniform(1, 1000) for _ in groups],
                                 [rng.uniform(1, 200) for _ in groups], pool=pool):
                work = dask.get_annotations()[WORK]
            s.tasks[key] = FakeTask("waiting", pins, {WORK: work} if rng.random() < 0.9 else {})
            plugin.transition(key, "released", "waiting", stimulus_id="test")
        elif roll < 0.5:  # queued, processing, ...: still queued work
            key = rng.choice(active)
            finish = rng.choice(sorted(ACTIVE - {s.tasks[key].state}))
            plugin.transition(key, s.tasks[key].state, finish, stimulus_id="test")
            s.tasks[key].state = finish
        elif roll < 0.8:
            key = rng.choice(active)
            finish = rng.choice(["memory", "erred", "released", "forgotten"])
            _leave(s, plugin, key, finish)
        elif roll < 0.9 and gone:  # a task that left comes back (a retry, a lost result)
            key = rng.choice(gone)
            s.tasks[key] = s.tasks.pop(key)  # in arrival order again
            s.tasks[key].state = "waiting"
            plugin.transition(key, "released", "waiting", stimulus_id="test")
            returned += 1
        else:  # a worker joins or leaves (a task pinned to it becomes free, or pinned)
            name = f"{rng.choice(pools)}-{rng.randrange(4)}"
            if s.workers.pop(f"tcp://{name}", None) is None:
                s.workers[f"tcp://{name}"] = FakeWorker(name)
        for pool in pools:
            keys, units, capacity = _recount(s, pool)
            queue = plugin.queues.get(pool, dask_plugin.QueuedWork())
            members = {w.address for w in s.workers.values() if pool_of(w.name) == pool}
            assert list(queue.work) == keys, step
            assert queue.units() == units, step
            assert queue.capacity(members) == capacity, step
            assert sum(queue.pin_counts.values()) == len(keys), step
            longest = max(longest, len(keys))
        for change in plugin.drain_changes():  # an arrival's plan saw the whole queue
            assert change["queued_tasks"] == len(_recount(s, "gen")[0]), step
    assert returned > 20 and longest > 20  # the sequence went somewhere
