"""KV transfer between generation workers of a real LocalCluster (worker processes).

A paused tail is exported on one worker, fetched by Dask directly by a task pinned to
another, and decoded on there: the result equals uninterrupted decoding on one worker
(float64 engines, greedy and sampled), every (prompt, sample) comes out exactly once, and a
source worker that dies once its KV was received loses nothing, and neither does one that
dies before (its tail is recomputed from the tokens the driver holds)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from tail_harness import TailModels, land_tails, run_tail
from worker_support import kill_worker

from rlhfless.ops.data.load import read_prompts
from rlhfless.ops.engine.engine_types import EngineSpec, SamplingParams, WeightsRef
from rlhfless.ops.engine.gen_stats import Generated
from rlhfless.pipeline.cluster.pools import Pool, PoolCluster
from rlhfless.pipeline.tasks.rollout import (
    GenSpec,
    generate_chunk_task,
    generation_engine,
    resume_task,
)
from rlhfless.pipeline.tasks.tail import adopt_tails_task, export_tail_task
from rlhfless.pipeline.train.step_profile import measure_step_profile
from rlhfless.schedulers.ledger import CostLedger
from rlhfless.schedulers.tail_cost import KvCosts, StepProfile, TransferModel
from rlhfless.schedulers.throughput import ThroughputModel

N_SAMPLES = 3


@pytest.fixture(scope="module")
def cluster():
    ledger = CostLedger({"gen": 1.0})
    with PoolCluster([Pool("gen", 3, 1, {"GEN": 1}, "2GiB")], ledger) as pc:
        yield pc


def _float64_engine(spec: GenSpec, weights: WeightsRef) -> str:
    """Load this worker's engine in float64: no near-tie can flip a token."""
    engine, _, _ = generation_engine(spec.engine, weights)
    engine.model.double()
    return str(engine.model.dtype)


def _setup(cluster, tiny_model_dir, greedy: bool):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    shard = read_prompts(tiny_model_dir / "train.jsonl", tok).table.slice(0, 5)
    spec = GenSpec(EngineSpec(str(tiny_model_dir)), N_SAMPLES,
                   SamplingParams(max_new_tokens=24, temperature=1.0, greedy=greedy))
    weights = WeightsRef(0, str(tiny_model_dir))
    addrs = [cluster.address_of(n) for n in cluster.worker_names("gen")]
    for a in addrs:
        assert cluster.client.submit(_float64_engine, spec, weights, workers=[a],
                                     pure=False).result() == "torch.float64"
    return shard, spec, weights, addrs


def _by_pair(tables: list[Generated]) -> dict:
    table = Generated.concat(tables).table
    pairs = list(zip(table.column("prompt_id").to_pylist(), table.column("sample_idx").to_pylist()))
    counts = Counter(pairs)
    assert set(counts.values()) == {1}, counts  # each (prompt, sample) exactly once
    return dict(zip(pairs, zip(table.column("response_ids").to_pylist(),
                               table.column("logprobs").to_pylist(),
                               table.column("worker").to_pylist())))


def _export_here(key: str, source: str) -> str:
    """``export_tail_task`` run off the worker that paused ``key``: what it does."""
    from distributed import Reschedule

    from rlhfless.pipeline.tasks.tail import TailLost

    try:
        export_tail_task(key, source)
    except Reschedule:
        return "rescheduled"
    except TailLost:
        return "lost"
    return "exported"


def test_an_export_stolen_off_its_live_source_goes_back_to_it(cluster, eos_model_dir):
    """Work stealing may move a loosely pinned export to a worker that does not hold the
    tail: while the source lives the task is rescheduled (not lost, so its KV still moves);
    only a source gone from the cluster makes it ``TailLost``."""
    shard, spec, weights, addrs = _setup(cluster, eos_model_dir, greedy=True)
    c = cluster.client
    c.submit(generate_chunk_task, shard, weights, spec, 0, 0.3, "stolen", workers=[addrs[0]],
             pure=False).result()
    for source, expected in ((addrs[0], "rescheduled"), (addrs[1], "lost"),
                             ("tcp://127.0.0.1:9", "lost")):
        assert c.submit(_export_here, "stolen", source, workers=[addrs[1]],
                        pure=False).result() == expected
    sent = c.submit(export_tail_task, "stolen", addrs[0], workers=[addrs[0]],
                    allow_other_workers=True, pure=False).result()
    assert sent.n_sequences > 0  # still there: nothing ran it off its source


def _move(c, key: str, src: str, dst: str, weights, spec, new_key: str):
    """Export on ``src``, adopt on ``dst``; the tail's data goes worker to worker."""
    sent = c.submit(export_tail_task, key, workers=[src], pure=False, key=f"export-{new_key}")
    facts = c.submit(adopt_tails_task, [sent], new_key, weights, spec, workers=[dst],
                     pure=False).result()
    holders = set(c.who_has([sent])[sent.key])
    return sent, facts, holders


@pytest.mark.parametrize("greedy", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_transfer_continuation_equals_uninterrupted(cluster, eos_model_dir, greedy):
    shard, spec, weights, (a, b, _) = _setup(cluster, eos_model_dir, greedy)
    c = cluster.client
    whole = c.submit(generate_chunk_task, shard, weights, spec, 5, 1.0, f"whole-{greedy}",
                     workers=[a], pure=False).result()
    assert len(whole["cut"]) == 0
    key = f"cut-{greedy}"
    out = c.submit(generate_chunk_task, shard, weights, spec, 5, 0.3, key, workers=[a],
                   pure=False).result()
    n_cut = len(out["cut"])
    assert 0 < n_cut < len(shard) * N_SAMPLES
    sent, facts, holders = _move(c, key, a, b, weights, spec, f"moved-{greedy}")
    assert facts["sequences"] == n_cut and facts["bytes"] > 0 and facts["context_tokens"] > 0
    assert holders == {a, b}  # fetched by the target from the source, not via the driver
    del sent
    rest = c.submit(resume_task, f"moved-{greedy}", weights, spec, workers=[b],
                    pure=False).result()
    reference, moved = _by_pair([whole["done"]]), _by_pair([out["done"], rest])
    assert reference.keys() == moved.keys()
    b_name = rest.table.column("worker")[0].as_py()
    assert b_name != out["done"].table.column("worker")[0].as_py()
    for pair, (ids, lps, _) in reference.items():
        assert moved[pair][0] == ids
        assert max((abs(x - y) for x, y in zip(moved[pair][1], lps)), default=0.0) < 1e-6
    assert sum(w == b_name for _, _, w in moved.values()) == n_cut


def test_the_start_profile_measures_both_sides_and_restores_threads(cluster, eos_model_dir):
    """``measure_step_profile``: 1 thread on both workers at once, 2 threads on one; every point
    sampled ``repeats`` times; the workers are left at the pool's thread count."""
    _, spec, weights, _ = _setup(cluster, eos_model_dir, greedy=True)
    names = cluster.worker_names("gen")[:2]
    profile = measure_step_profile(cluster, names, spec, weights, (1, 4), steps=4, repeats=3)
    assert profile.threads == [1, 2] and sorted(profile.measured) == [
        (1, 1), (1, 2), (4, 1), (4, 2)]
    assert all(len(v) == 3 and min(v) > 0 for v in profile.measured.values())
    assert 0 <= profile.noise < float("inf")
    addrs = [cluster.address_of(n) for n in names]
    assert set(cluster.client.run(torch.get_num_threads, workers=addrs).values()) == {1}


def test_source_dying_after_sending_loses_nothing(cluster, eos_model_dir):
    shard, spec, weights, (a, b, c_addr) = _setup(cluster, eos_model_dir, greedy=False)
    c = cluster.client
    out = c.submit(generate_chunk_task, shard, weights, spec, 9, 0.3, "dying", workers=[c_addr],
                   pure=False).result()
    assert len(out["cut"]) > 0
    sent, facts, _ = _move(c, "dying", c_addr, b, weights, spec, "survivor")
    kill_worker(cluster, c_addr)
    del sent
    rest = c.submit(resume_task, "survivor", weights, spec, workers=[b], pure=False).result()
    done = _by_pair([out["done"], rest])
    assert len(done) == len(shard) * N_SAMPLES
    assert len(rest) == facts["sequences"] == len(out["cut"])
    cluster.wait_for([cluster.worker_names("gen")[2]])  # its nanny restarts it


@pytest.mark.slow  # a second kill and restart: 6-8 s
def test_source_dying_before_its_kv_is_fetched_loses_nothing(cluster, eos_model_dir):
    """The source exported its tail's KV and died before the target fetched it: ``land_tails``
    recomputes that tail on the target from the cut rows, and the continuation (greedy,
    float64) equals uninterrupted decoding."""
    shard, spec, weights, (a, b, c_addr) = _setup(cluster, eos_model_dir, greedy=True)
    c = cluster.client
    whole, out = c.gather([
        c.submit(generate_chunk_task, shard, weights, spec, 5, 1.0, "orphan-whole", workers=[b],
                 pure=False),
        c.submit(generate_chunk_task, shard, weights, spec, 5, 0.3, "orphan", workers=[c_addr],
                 pure=False)])
    assert len(out["cut"]) > 0
    sent = c.submit(export_tail_task, "orphan", workers=[c_addr], allow_other_workers=True,
                    pure=False)
    assert sent.result().n_sequences == len(out["cut"])  # exported, held by the source only
    kill_worker(cluster, c_addr)
    facts, lost = land_tails(c, b, {"src": sent}, {"src": out["cut"]}, [], "orphan-landed", (),
                             weights, spec, 5)
    assert lost == ["src"] and facts["bytes"] == 0 and facts["recompute_tokens"] > 0
    del sent
    rest = c.submit(resume_task, "orphan-landed", weights, spec, workers=[b], pure=False).result()
    reference, moved = _by_pair([whole["done"]]), _by_pair([out["done"], rest])
    assert reference.keys() == moved.keys() and len(rest) == len(out["cut"])
    for pair, (ids, lps, _) in reference.items():
        assert moved[pair][0] == ids
        assert max((abs(x - y) for x, y in zip(moved[pair][1], lps)), default=0.0) < 1e-6
    cluster.wait_for([cluster.worker_names("gen")[2]])  # its nanny restarts it


@pytest.mark.parametrize("mode", ["kv", pytest.param("reconfig", marks=pytest.mark.slow)])
def test_tail_modes_consolidate_and_lose_nothing(cluster, eos_model_dir, mode):
    """``bench/tail_harness.run_tail`` on two workers: the tails are consolidated on one (KV sent,
    priors that make transfer the cheaper path), the other released; under ``reconfig`` a
    profile in which two threads pay makes it fire and widen the target."""
    shard, spec, weights, _ = _setup(cluster, eos_model_dir, greedy=False)
    names = cluster.worker_names("gen")[:2]
    one = {(b, 1): [0.01 + 0.001 * b] for b in (1, 8)}
    profile = StepProfile(one | {(b, 2): [s / 1.9] for (b, _), (s,) in one.items()})
    models = TailModels(KvCosts(ThroughputModel(),
                                TransferModel(prior_latency_s=0.0, prior_bytes_per_s=1e15),
                                kv_bytes_per_token=2048), profile)
    shards = [shard.take([0, 2, 4]), shard.take([1, 3])]
    res = run_tail(cluster, names, shards, spec, weights, mode, 0.3, models,
                   lambda n: 24.0, f"modes-{mode}")
    pairs = _by_pair([Generated(res["rollouts"])])
    assert len(pairs) == len(shard) * N_SAMPLES
    decision = res["decision"]
    assert len(decision["tails"]) == 2, decision  # both paused with a tail
    (move,) = decision["moves"]
    assert move["path"] == "transfer" and move["actual_s"] > 0
    assert res["released"] == [move["source"]]
    assert move["source"] not in cluster.worker_names("gen")
    if mode == "reconfig":
        assert decision["reconfig"]["fire"] and decision["threads"]["after"] == 2
    cluster.grow("gen", 1)



@pytest.mark.slow  # a static and a split run: 20-30 s
def test_split_sheds_the_heavy_tail_and_decodes_as_static(cluster, eos_model_dir):
    """``split`` mode: the light worker at ``tau`` pauses the heavy one, which sheds part of
    its tail (KV sent) to the light one and keeps decoding the rest; no worker is released
    and the rollouts equal the static run's (sampled, float64)."""
    shard, spec, weights, _ = _setup(cluster, eos_model_dir, greedy=False)
    names = cluster.worker_names("gen")[:2]
    one = {(b, 1): [0.01 + 0.002 * b] for b in (1, 8)}
    models = TailModels(KvCosts(ThroughputModel(),
                                TransferModel(prior_latency_s=0.0, prior_bytes_per_s=1e15),
                                kv_bytes_per_token=2048), StepProfile(one))
    # seeded lengths: at tau 0.25 the light shard pauses after 4 steps with 2 of its 3
    # sequences left, the heavy one (paused by then, or at its own tau after 12 steps) with
    # 9 or more of 12: shedding pays whichever way the race between them goes
    shards = [shard.take([0, 1, 3, 4]), shard.take([2])]
    static = run_tail(cluster, names, shards, spec, weights, "static", 1.0, models,
                      lambda n: 24.0, "split-static")
    res = run_tail(cluster, names, shards, spec, weights, "split", 0.25, models,
                   lambda n: 24.0, "split")
    expected = _by_pair([Generated(static["rollouts"])])
    got = _by_pair([Generated(res["rollouts"])])
    assert got.keys() == expected.keys()
    for pair, (ids, lps, _) in got.items():
        assert ids == expected[pair][0]
        assert max((abs(x - y) for x, y in zip(lps, expected[pair][1])), default=0.0) < 1e-6
    decision = res["decision"]
    assert decision["split"]["fire"], decision
    moves = decision["moves"]
    assert {m["source"] for m in moves} == {names[0]} and {m["target"] for m in moves} == {names[1]}
    assert all(m["path"] == "transfer" and m["actual_s"] > 0 for m in moves)
    assert res["released"] == [] and set(names) <= set(cluster.worker_names("gen"))
    assert set(res["rollouts"].column("worker").to_pylist()) == set(names)
