"""The scheduler plugin's targets and veto, and PoolAdaptive, against in-memory fakes.

As dask's own ``deploy/tests/test_adaptive_core.py`` does: no cluster, no processes. The
plugin runs on a fake scheduler state (workers, tasks, plugins, handlers); ``PoolAdaptive``
runs Dask's real ``Adaptive`` / ``AdaptiveCore`` logic over a fake cluster whose scheduler
comm dispatches to those handlers. The real-LocalCluster test is in
``tests/pipeline/test_elastic.py``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from rlhfless.schedulers.dask_adaptive import PoolAdaptive
from rlhfless.schedulers.dask_plugin import ElasticityPlugin


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
