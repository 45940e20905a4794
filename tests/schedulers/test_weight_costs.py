"""Cold starts and weight fetches priced at the model's size (pure, no Dask): the same work
at the same measured rates gets another worker count at Qwen2.5-0.5B's size than at a tiny
model's, a LoRA run, which sends its adapter alone, keeps workers that a full-weight run of
the same model releases, and the fetches a run measures replace the prior."""

from __future__ import annotations

import numpy as np
import pytest

from rlhfless.ops.engine.gen_stats import GenerationStats
from rlhfless.schedulers.scaling import choose_generation_workers
from rlhfless.schedulers.scaling_policy import IterationTimings, ScalingKnobs, ScalingPolicy
from rlhfless.schedulers.throughput import ThroughputModel
from rlhfless.schedulers.weight_costs import WeightCosts

QWEN_05B = 494_032_768  # Qwen2.5-0.5B's parameters, tied embeddings once
TINY = 800_000  # the embedded tiny model's order
# rank-16 adapters on q, k, v, o of its 24 layers: r * (in + out) each, hidden 896, kv 128
ADAPTER = 24 * 16 * ((896 + 896) + 2 * (896 + 128) + (896 + 896))
RATES = {"bytes_per_param": 4, "load_gbs": 1.0, "engine_start_s": 1.0}  # fp32 weights
STEPS = {"step_intercept_s": 0.01, "step_slope_s": 1e-3}  # decode: a + c * live batch
GROUPS, SAMPLES, LENGTH = 16, 8, 256  # the work: 16 groups of 8 samples of 256 tokens


def _decide(costs: WeightCosts, keep_warm: int):
    return choose_generation_workers(np.full(GROUPS, float(LENGTH)), SAMPLES,
                                     costs.throughput(**STEPS), max_workers=8,
                                     lambda_cost=0.5, keep_warm=keep_warm)


def _decode_s(groups_per_worker: int) -> float:
    """One worker's decode seconds: a x its longest sequence + c x its tokens."""
    return STEPS["step_intercept_s"] * LENGTH + STEPS["step_slope_s"] * (
        groups_per_worker * SAMPLES * LENGTH)


def test_the_costs_are_the_bytes_over_the_measured_rates():
    costs = WeightCosts.of_model(QWEN_05B, fetch_gbs=2.0, **RATES)
    assert costs.cold_start_s == pytest.approx(1.0 + QWEN_05B * 4 / 1e9, rel=1e-12)
    assert costs.fetch_s == pytest.approx(QWEN_05B * 4 / 2e9, rel=1e-12)
    lora = WeightCosts.of_model(QWEN_05B, fetch_gbs=2.0, adapter_params=ADAPTER, **RATES)
    assert lora.cold_start_s == costs.cold_start_s  # the base loads whole either way
    assert lora.fetch_s == pytest.approx(ADAPTER * 4 / 2e9, rel=1e-12)
    with pytest.raises(ValueError, match="fetch_gbs = 0 must be > 0"):
        WeightCosts.of_model(QWEN_05B, fetch_gbs=0, **RATES)


def test_a_real_model_size_starts_fewer_workers_than_a_tiny_one():
    """One warm worker: at tiny size a cold start is the engine's 1 s and the fetch 1.6 ms,
    so all 8 workers start; at 0.5B each new worker also reads 1.98 GB (2.98 s cold) and
    every worker fetches 0.99 s per version, and 4 workers score best."""
    tiny = _decide(WeightCosts.of_model(TINY, fetch_gbs=2.0, **RATES), keep_warm=1)
    full = WeightCosts.of_model(QWEN_05B, fetch_gbs=2.0, **RATES)
    real = _decide(full, keep_warm=1)
    assert (tiny.n_workers, real.n_workers) == (8, 4)
    # each of the 4 workers decodes 4 groups and fetches the version; 3 start cold
    warm_s = _decode_s(4) + full.fetch_s
    expected = np.array([warm_s] + [warm_s + full.cold_start_s] * 3)
    np.testing.assert_allclose(np.sort(real.worker_seconds), expected, rtol=1e-12)


def test_an_adapter_fetch_keeps_the_warm_workers_a_full_fetch_releases():
    """All 8 workers warm, fetch at 1 GB/s: full weights cost each worker 1.98 s per
    version and 4 workers score best; a rank-16 adapter costs 8.7 ms and all 8 stay."""
    full = _decide(WeightCosts.of_model(QWEN_05B, fetch_gbs=1.0, **RATES), keep_warm=8)
    lora = _decide(WeightCosts.of_model(QWEN_05B, fetch_gbs=1.0, adapter_params=ADAPTER,
                                        **RATES), keep_warm=8)
    assert (full.n_workers, lora.n_workers) == (4, 8)


def test_measured_fetches_replace_the_prior_and_move_the_decision():
    """The live runtime reports each shard's fetch (``GenerationStats.weight_fetch_s``); the
    policy's fetch price becomes their EWMA (alpha 0.3 after the first), survives a
    checkpoint, and the 2.15 s it reaches on a model priced as tiny cuts 8 warm workers to 4
    as the 0.5B prior does."""
    policy = ScalingPolicy(ScalingKnobs(), WeightCosts.of_model(
        TINY, fetch_gbs=1.0, **RATES).throughput(**STEPS))
    assert policy.throughput.weight_fetch_s == pytest.approx(TINY * 4 / 1e9)

    def plan():
        return policy.plan(np.full(GROUPS, float(LENGTH)), np.full(GROUPS, float(LENGTH)),
                           SAMPLES, np.zeros(GROUPS), keep_warm=8, max_workers=8).n_workers

    assert plan() == 8
    shards = [GenerationStats(weight_fetch_s=s) for s in (2.0, 0.0, 2.5)]  # 0: had it
    policy.observe_iteration(["p"], [LENGTH], IterationTimings(0.0, shards, []))
    assert policy.throughput.weight_fetch_s == pytest.approx(0.3 * 2.5 + 0.7 * 2.0)
    assert plan() == 4
    restored = ScalingPolicy(ScalingKnobs(), ThroughputModel())
    restored.load_state_dict(policy.state_dict())
    assert restored.throughput.weight_fetch_s == policy.throughput.weight_fetch_s
