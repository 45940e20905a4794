"""Every pool's workers start together: the first workers of all pools are one SpecCluster
``scale`` (a second one waits for the first one's workers to finish starting), and each
worker imports its pool's task modules (``Pool.preload``) before it registers."""

from __future__ import annotations

import os
import signal
import time

import dask
from distributed.nanny import WorkerProcess

from rlhfless.pipeline.cluster.deploy import LocalDeployment
from rlhfless.pipeline.cluster.pools import (
    GEN_TASKS,
    TAIL_TASKS,
    TRAIN_TASKS,
    Pool,
    PoolCluster,
    pools_from_config,
)
from rlhfless.pipeline.config import Config
from rlhfless.schedulers.ledger import CostLedger


def test_each_pool_preloads_its_task_module():
    gen, train = pools_from_config(Config())
    assert gen.preload == (*GEN_TASKS, *TAIL_TASKS) and train.preload == TRAIN_TASKS
    assert "rlhfless.pipeline.tasks.tail" in gen.preload  # our engine's workers move tails
    assert LocalDeployment().worker_spec(gen, "gen-0")["options"]["preload"] == list(
        gen.preload)


def test_workers_of_an_engine_that_exports_no_kv_do_not_import_the_tail_tasks():
    """vLLM's workers never move a KV cache: they preload the generation tasks alone; the
    emulated engine's, which move their tails as data, preload the tail tasks too (which
    import no framework: ``test_emulated_engine.py``)."""
    gen, _ = pools_from_config(Config(backend="vllm"))
    assert gen.preload == GEN_TASKS
    gen, _ = pools_from_config(Config(backend="emulated"))
    assert gen.preload == (*GEN_TASKS, *TAIL_TASKS)


def _preloaded(dask_worker) -> bool:
    import sys
    return "slow_start" in sys.modules


def test_the_pools_workers_preload_at_once(tmp_path, monkeypatch):
    """Two pools whose preload ends only once the other pool's preload has begun: each
    preload saw both start, so they ran at the same time (started one after the other, the
    first would wait alone and give up); each worker has imported its preload before its
    first task."""
    log = tmp_path / "starts"
    monkeypatch.setenv("SLOW_START_LOG", str(log))
    monkeypatch.setenv("SLOW_START_PEERS", "2")
    pools = [Pool("gen", 1, 1, {"GEN": 1}, "2GiB", preload=("slow_start",)),
             Pool("train", 1, 1, {"TRAIN": 1}, "2GiB", preload=("slow_start",))]
    with PoolCluster(pools, CostLedger({"gen": 1.0, "train": 1.0})) as pc:
        preloaded = pc.client.run(_preloaded)
    seen = [int(words[2]) for words in map(str.split, log.read_text().splitlines())
            if words[1] == "end"]
    assert seen == [2, 2], "a pool's preload ended before the other pool's began"
    assert list(preloaded.values()) == [True, True]


def test_a_killed_local_worker_comes_back_however_long_its_restart_takes(monkeypatch):
    """SIGKILL a worker while Dask's lost-worker timeout is shorter than any restart (a
    process spawn and its imports): its nanny restarts it, it stays in the pool under its
    name (before, SpecCluster closed the restarting nanny when the timeout passed), and
    ``address_of`` waits for it instead of raising while it is away.

    The nanny here notices its worker's start up to 2 s after the worker registered (a
    loaded machine's lag, widened): the kill comes right after the cluster started, so it
    lands in that lag unless starting waits for the nanny too (before, it failed the
    nanny's start and SpecCluster closed the nanny for good)."""
    monkeypatch.setattr(WorkerProcess, "_init_msg_interval", 2.0)
    pools = [Pool("train", 1, 1, {"TRAIN": 1}, "2GiB")]
    with (dask.config.set({"distributed.deploy.lost-worker-timeout": "50ms"}),
          PoolCluster(pools, CostLedger({"gen": 1.0, "train": 1.0}),
                      deployment=LocalDeployment(start_timeout_s=60)) as pc):
        (address, pid), = pc.client.run(os.getpid).items()
        os.kill(pid, signal.SIGKILL)
        deadline = time.time() + 60
        while address in pc.client.scheduler_info(n_workers=-1)["workers"]:
            assert time.time() < deadline, "the scheduler never saw the worker go"
            time.sleep(0.01)
        assert pc.address_of("train-0") != address  # waited for the restarted worker
        time.sleep(0.5)  # ten lost-worker timeouts: a close would have happened by now
        assert pc.connected() == {"train-0"} and pc.worker_names("train") == ["train-0"]
        assert pc.client.submit(os.getpid, resources={"TRAIN": 1}).result(30) != pid
