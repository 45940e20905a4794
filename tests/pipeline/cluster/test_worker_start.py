"""Every pool's workers start together: the first workers of all pools are one SpecCluster
``scale`` (a second one waits for the first one's workers to finish starting), and each
worker imports its pool's task modules (``Pool.preload``) before it registers."""

from __future__ import annotations

from rlhfless.pipeline.cluster.deploy import LocalDeployment
from rlhfless.pipeline.cluster.pools import (
    GEN_TASKS,
    TRAIN_TASKS,
    Pool,
    PoolCluster,
    pools_from_config,
)
from rlhfless.pipeline.config import Config
from rlhfless.schedulers.ledger import CostLedger


def test_each_pool_preloads_its_task_module():
    gen, train = pools_from_config(Config())
    assert gen.preload == (GEN_TASKS,) and train.preload == (TRAIN_TASKS,)
    assert LocalDeployment().worker_spec(gen, "gen-0")["options"]["preload"] == [GEN_TASKS]


def _preloaded(dask_worker) -> bool:
    import sys
    return "slow_start" in sys.modules


def test_the_pools_workers_preload_at_once(tmp_path, monkeypatch):
    """Two pools whose preload takes 3 s each: both preloads run at the same time, so the
    cluster is up after one of them, not two; each worker has imported its preload before
    its first task."""
    log = tmp_path / "starts"
    monkeypatch.setenv("SLOW_START_LOG", str(log))
    pools = [Pool("gen", 1, 1, {"GEN": 1}, "2GiB", preload=("slow_start",)),
             Pool("train", 1, 1, {"TRAIN": 1}, "2GiB", preload=("slow_start",))]
    with PoolCluster(pools, CostLedger({"gen": 1.0, "train": 1.0})) as pc:
        preloaded = pc.client.run(_preloaded)
    (a_start, a_end), (b_start, b_end) = sorted(
        tuple(map(float, line.split()[1:])) for line in log.read_text().splitlines())
    assert b_start < a_end, "the second pool's worker started after the first one's preload"
    assert list(preloaded.values()) == [True, True]
