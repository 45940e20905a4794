"""Elasticity on a real LocalCluster: cut-and-migrate, scale up/down, vetoes, the ledger."""

from __future__ import annotations

import time
from collections import Counter

import pyarrow.parquet as pq
import pytest

from rlhfless.ops.data.load import read_prompts
from rlhfless.ops.engine.engine_types import EngineSpec, SamplingParams, WeightsRef
from rlhfless.ops.engine.gen_stats import Generated
from rlhfless.pipeline.cluster.pools import ADAPT_INTERVAL_S, Pool, PoolCluster
from rlhfless.pipeline.config import Config
from rlhfless.pipeline.tasks.rollout import (
    GenSpec,
    continue_task,
    drop_task,
    generate_chunk_task,
    resume_task,
)
from rlhfless.pipeline.train.loop import train
from rlhfless.schedulers.dask.plugin import (
    PLUGIN_NAME,
    drain_target_changes,
    generation_work,
    install_sizing,
)
from rlhfless.schedulers.ledger import CostLedger
from rlhfless.schedulers.scaling_policy import ScalingKnobs, ScalingPolicy
from rlhfless.schedulers.throughput import ThroughputModel

N_SAMPLES = 4


@pytest.fixture(scope="module")
def cluster():
    ledger = CostLedger({"gen": 1.0, "train": 1.0})
    pools = [Pool("gen", 2, 1, {"GEN": 1}, "2GiB"), Pool("train", 1, 1, {"TRAIN": 1}, "2GiB")]
    with PoolCluster(pools, ledger) as pc:
        yield pc


def _pairs(tables: list[Generated]) -> Counter:
    table = Generated.concat(tables).table
    return Counter(zip(table.column("prompt_id").to_pylist(),
                       table.column("sample_idx").to_pylist()))


def _setup(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    shard = read_prompts(tiny_model_dir / "train.jsonl", tok).table.slice(0, 6)
    spec = GenSpec(EngineSpec(str(tiny_model_dir)), N_SAMPLES,
                   SamplingParams(max_new_tokens=24, temperature=1.0))
    return shard, spec, WeightsRef(0, str(tiny_model_dir))


@pytest.mark.parametrize("migrate", [False, True])
def test_cut_then_resume_or_migrate_yields_each_sample_once(cluster, tiny_model_dir, migrate):
    shard, spec, weights = _setup(tiny_model_dir)
    a, b = (cluster.address_of(n) for n in cluster.worker_names("gen")[:2])
    c = cluster.client
    key = f"chunk-{migrate}"
    out = c.submit(generate_chunk_task, shard, weights, spec, 1, 0.25, key, workers=[a],
                   pure=False).result()
    cut = out["cut"]
    assert 0 < len(cut) < len(shard) * N_SAMPLES  # paused after a quarter finished
    if migrate:
        assert c.submit(drop_task, key, workers=[a], pure=False).result()
        halves = [cut.slice(0, len(cut) // 2), cut.slice(len(cut) // 2)]
        rest = [c.submit(continue_task, h, weights, spec, 7, workers=[b], pure=False).result()
                for h in halves]
        assert set(Generated.concat(rest).table.column("worker").to_pylist()) == {
            cluster.worker_names("gen")[1]}
    else:
        rest = [c.submit(resume_task, key, weights, spec, workers=[a], pure=False).result()]
    pairs = _pairs([out["done"], *rest])
    assert len(pairs) == len(shard) * N_SAMPLES and set(pairs.values()) == {1}
    table = Generated.concat(rest).table
    partial = {(p, s): g for p, s, g in zip(cut.column("prompt_id").to_pylist(),
                                             cut.column("sample_idx").to_pylist(),
                                             cut.column("partial_ids").to_pylist())}
    for p, s, ids, lps in zip(table.column("prompt_id").to_pylist(),
                              table.column("sample_idx").to_pylist(),
                              table.column("response_ids").to_pylist(),
                              table.column("logprobs").to_pylist()):
        assert ids[: len(partial[(p, s)])] == partial[(p, s)]  # continued, not restarted
        assert len(ids) == len(lps) <= 24


def test_worker_with_pinned_work_is_not_retired(cluster):
    name = cluster.worker_names("gen")[0]
    address = cluster.address_of(name)
    c = cluster.client
    running = c.submit(time.sleep, 1.5, workers=[address], resources={"GEN": 1}, pure=False)
    queued = c.submit(time.sleep, 0.1, workers=[address], resources={"GEN": 1}, pure=False)
    time.sleep(0.5)
    assert cluster.retire([name]) == []  # busy, and a waiting task is pinned to it
    assert name in cluster.worker_names("gen")
    c.gather([running, queued])
    del running, queued


def test_pool_scales_through_dask_adaptive(cluster):
    before = cluster.worker_names("gen")
    grown = cluster.scale("gen", len(before) + 1)
    new = [w for w in grown if w not in before]
    assert len(new) == 1 and set(grown) <= cluster.connected()
    assert cluster.adaptive.log[-1][1] == {"status": "up", "n": len(grown)}
    time.sleep(2.5 * ADAPT_INTERVAL_S)  # periodic adaptive steps: the target holds
    assert cluster.worker_names("gen") == grown
    assert cluster.scale("gen", len(before), close=new) == before
    assert cluster.adaptive.log[-1][1] == {"status": "down", "workers": new}
    assert not set(new) & cluster.connected()
    assert new[0] not in cluster.ledger.running()  # billed until its process exited


def _timed_sleep(seconds: float) -> tuple[float, float]:
    start = time.time()
    time.sleep(seconds)
    return start, time.time()


def test_ledger_agrees_with_measured_lifetime(cluster):
    """The billed life lies inside the driver's window (grow called .. retire returned) and
    holds the task the worker ran: orders of clock readings, whatever the machine's load."""
    requested = time.time()
    (name,) = cluster.grow("gen", 1)
    ran = cluster.client.submit(_timed_sleep, 2.0, workers=[cluster.address_of(name)],
                                pure=False).result()
    assert cluster.retire([name]) == [name]  # returns once the worker process has exited
    gone = time.time()
    cluster.sync_events()
    life = next(r for r in cluster.ledger.records() if r["name"] == name)
    assert requested <= life["t_start"] <= life["t_ready"] <= ran[0]
    assert ran[0] + 2.0 <= ran[1] <= life["t_end"] <= gone
    assert life["worker_s"] == pytest.approx(life["t_end"] - life["t_start"])


def _until(done, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not done():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def test_queued_generation_work_grows_and_drains_the_pool(cluster):
    """Three annotated generation tasks free to run on any generation worker: the plugin's
    sizing rule raises the target to three, Dask's periodic adaptive step grows the pool
    with no call from the driver; once they are done the queue has drained, the idle gap
    (10 s of update) exceeds the keep-alive (a 1 s cold start) and the pool is released.
    The last test of the module's cluster: it leaves no generation worker."""
    scaling = ScalingPolicy(ScalingKnobs(), ThroughputModel(step_slope_s=0.01, cold_start_s=1.0))
    scaling.update_seconds = 10.0
    c = cluster.client
    before = cluster.worker_names("gen")
    c.run_on_scheduler(install_sizing, pool="gen", sizing=scaling.sizing(4, 3))
    try:
        futures = []
        for i in range(3):
            with generation_work([2000.0] * 4, [600.0] * 4, [50.0] * 4):
                futures.append(c.submit(time.sleep, 0.3, key=f"generate-9-{i}",
                                        resources={"GEN": 1}, pure=False))
        _until(lambda: len(cluster.worker_names("gen")) == 3)  # Adaptive grew it
        c.gather(futures)
        del futures
        _until(lambda: not cluster.connected() & {*before, *cluster.worker_names("gen")}
               and not cluster.worker_names("gen"))
    finally:
        c.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins[PLUGIN_NAME]
                           .sizing.clear())
    changes = c.run_on_scheduler(drain_target_changes)
    assert [c["to"] for c in changes][-1] == 0 and max(c["to"] for c in changes) == 3
    assert all(c["kind"] == "queue_target" for c in changes)
    cluster.sync_events()
    grown = [r for r in cluster.ledger.records() if r["kind"] == "worker"
             and r["pool"] == "gen" and r["name"] not in before]
    assert grown and all(r["t_end"] is not None for r in grown)  # billed until they left
    assert cluster.ledger.running("gen") == []
    assert not cluster.adaptive.requested_at  # each worker it started billed from its request


def test_elastic_run_scales_and_loses_no_sample(tiny_model_dir, tmp_path):
    cfg = Config(model=str(tiny_model_dir), runs_dir=str(tmp_path), iterations=2,
                 batch_prompts=8, n_samples=3, max_new_tokens=16, heldout_prompts=8,
                 eval_every=2, policy="elastic", gen_workers=2, lambda_cost=1.0,
                 tau=0.5, keep_alive_s=0.0, train_threads=1)
    run = train(cfg, progress=False, log=lambda *_: None)
    decisions = run.read_jsonl("decisions.jsonl")
    kinds = Counter(d["kind"] for d in decisions)
    assert kinds["scale"] == 2 and kinds["release"] >= 1  # keep-alive 0: released when idle
    assert any(d["to"] > d["from"] for d in decisions if d["kind"] == "scale")
    for it in (1, 2):
        table = pq.read_table(run.path / "rollouts" / f"iter-{it:05d}.parquet")
        pairs = Counter(zip(table.column("prompt_id").to_pylist(),
                            table.column("sample_idx").to_pylist()))
        assert len(pairs) == 24 and set(pairs.values()) == {1}
        assert set(table.column("policy_version").to_pylist()) == {it - 1}
    ledger = run.read_json("ledger.json")
    assert ledger["totals"]["gen_worker_s"] > 0 and ledger["totals"]["train_worker_s"] > 0


def test_adaptive_damps_a_flapping_target_and_closes_the_idle_worker_holding_least():
    """Dask's Adaptive on a real LocalCluster (the fakes of tests/schedulers test the same
    rules): with wait_count = 2 a lower target closes nothing until it is recommended twice
    in a row, a target that comes back resets the count, and the worker closed is the idle
    one holding the least data, never the trainer."""
    from rlhfless.schedulers.dask.adaptive import PoolAdaptive
    from rlhfless.schedulers.dask.plugin import set_pool_target

    pools = [Pool("gen", 2, 1, {"GEN": 1}, "1GiB"), Pool("train", 1, 1, {"TRAIN": 1}, "1GiB")]
    with PoolCluster(pools, CostLedger({"gen": 1.0, "train": 1.0})) as pc:
        pc.adaptive.stop()  # its periodic steps would race the ones taken here
        adapt = PoolAdaptive(pc.cluster, pool="gen", interval=0, wait_count=2)
        held = pc.client.submit(bytes, 10_000_000, workers=[pc.address_of("gen-0")],
                                pure=False)
        held.result()

        def step(target: int) -> list[str]:
            pc.client.run_on_scheduler(set_pool_target, pool="gen", n=target)
            pc.cluster.sync(adapt.adapt)
            return sorted(pc.connected())

        everyone = ["gen-0", "gen-1", "train-0"]
        assert step(1) == everyone  # recommended once: not yet firm
        assert step(2) == everyone  # the target came back: the count resets
        assert step(1) == everyone
        _until(lambda: step(1) == ["gen-0", "train-0"])  # firm: gen-1 holds no data
        assert [entry["status"] for _, entry in adapt.log] == ["down"]
        del held
