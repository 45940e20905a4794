"""Simulator inputs: synthetic and replayed traces, derived and fitted profiles."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from rlhfless.schedulers.profiles import (
    H100,
    L40S,
    LLAMA2_70B,
    PROFILES,
    QWEN25_3B,
    derive_profile,
    get_profile,
)
from rlhfless.schedulers.sim.profile_fit import profile_from_run
from rlhfless.schedulers.sim.workloads import (
    GSM8K,
    REASONING,
    WorkloadConfig,
    drift_stats,
    replay_trace,
    synthetic_trace,
)

RUN = Path(__file__).parents[2] / "data" / "recorded_run"


def test_reasoning_lengths_hit_p50_p99_and_cap():
    cfg = dataclasses.replace(REASONING, iterations=8, batch_prompts=512)
    stats = drift_stats(synthetic_trace(cfg))
    assert stats["p50"] == pytest.approx(500, rel=0.1)
    assert stats["p99"] == pytest.approx(5000, rel=0.2)
    assert stats["max"] <= cfg.max_response_tokens


def test_gsm8k_drift_is_mostly_small():
    cfg = dataclasses.replace(GSM8K, dataset_prompts=1024, batch_prompts=512, iterations=8)
    trace = synthetic_trace(cfg)
    stats = drift_stats(trace)
    assert stats["n_changes"] > 1000
    assert stats["frac_change_under_50"] == pytest.approx(0.7, abs=0.05)
    assert trace.meta["drift_rho"] < 1.0  # drift was needed on top of sampling noise
    b = trace.batches[0]
    assert b.lengths.shape == (512, cfg.n_samples) and b.lengths.min() >= 1
    assert len(set(b.prompt_ids.tolist())) == 512  # one epoch: no repeats inside a batch


def test_traces_are_deterministic_and_validated():
    cfg = dataclasses.replace(GSM8K, iterations=2)
    a, b = synthetic_trace(cfg), synthetic_trace(cfg)
    np.testing.assert_array_equal(a.batches[1].lengths, b.batches[1].lengths)
    with pytest.raises(ValueError, match="response_p50 < response_p99"):
        WorkloadConfig(response_p50=600, response_p99=500)


def test_replay_of_the_recorded_run():
    trace = replay_trace(RUN)
    assert len(trace) >= 6 and trace.n_samples == 8
    for b, m in zip(trace.batches, trace.measured, strict=True):
        assert b.workers is not None and set(np.unique(b.workers)) <= {0, 1}
        assert b.lengths.max() <= trace.max_response_tokens
        assert int(b.lengths.sum()) == int(m["decode_tokens"])
        assert len(m["shard_gen_s"]) == 2 and min(m["shard_gen_s"]) > 0
    with pytest.raises(FileNotFoundError, match="no iter-"):
        replay_trace(RUN / "rollouts")


def test_derived_profiles_follow_the_spec_sheets():
    p = derive_profile(L40S, QWEN25_3B)
    # bf16 weights read once per step at 80 % of 864 GB/s, plus 1 ms of overhead
    assert p.step_base_s == pytest.approx(6.18e9 / (0.8 * 864e9) + 1e-3, rel=1e-6)
    assert p.tp == 1 and p.kv_capacity_tokens > 500_000
    big = derive_profile(H100, LLAMA2_70B)
    assert big.tp == 4 and big.step_base_s < p.step_base_s * 2
    assert p.batch_cap(500) == 1024 and big.batch_cap(4_096) < 1024
    assert {"Qwen2.5-3B@L40S", "Qwen2.5-7B@H100", "Llama2-70B@H100"} <= set(PROFILES)
    with pytest.raises(ValueError, match="unknown profile"):
        get_profile("GPT-5@TPU")
    with pytest.raises(ValueError, match="does not fit"):
        derive_profile(L40S, dataclasses.replace(LLAMA2_70B, tp=1))


def test_profile_fitted_from_the_recorded_run():
    p = profile_from_run(RUN)
    assert p.step_base_s + p.step_per_seq_s + p.step_per_ctx_token_s > 0
    assert p.update_tokens_per_s_per_gpu > 0 and p.iteration_overhead_s >= 0
    with pytest.raises(ValueError, match="no iterations to fit"):
        profile_from_run(RUN, fit_iterations=[999])


def test_engine_variants_follow_verl_defaults_and_keep_overrides():
    p = get_profile("Qwen2.5-3B@L40S")
    old = p.variant("verl-0.3")
    assert old.tp == 2 and old.engine == "verl-0.3"
    # eager: every step 90/65 of the graph-captured one; half the memory for the KV cache
    graphs = p.variant("dedicated", tp=2)
    assert old.step_base_s == pytest.approx(graphs.step_base_s * 90 / 65)
    assert old.kv_capacity_tokens < graphs.kv_capacity_tokens
    assert graphs.step_base_s < p.step_base_s  # weights split over 2 GPUs...
    assert graphs.step_base_s > p.step_base_s / 2  # ...plus two all-reduces per layer
    # learner: update 8N and forward-only 2N FLOPs per token, two forward passes
    assert p.update_tokens_per_s_per_gpu * 4 == pytest.approx(p.forward_tokens_per_s_per_gpu)
    assert p.learner_forward_passes == 2
    tweaked = p.replace(gen_cold_start_s=99.0).variant("verl-0.3")
    assert tweaked.gen_cold_start_s == 99.0 and tweaked.tp == 2
    big = get_profile("Llama2-70B@H100")
    assert big.feasible_tps("verl-0.3") == [4, 8]  # TP 2 does not fit at half the memory
    fitted = profile_from_run(RUN)
    assert fitted.variant("verl-0.3", tp=4) is fitted  # measured: no variants


def test_truncation_mass_and_persistent_long_prompts():
    cfg = dataclasses.replace(GSM8K, dataset_prompts=512, batch_prompts=512, iterations=4,
                              clip_ratio=0.01, long_prompt_frac=0.05, long_prompt_factor=3.0)
    trace = synthetic_trace(cfg)
    stats = drift_stats(trace)
    assert stats["clip_ratio"] == pytest.approx(0.01, abs=0.004)
    # the same prompts run long epoch after epoch: top 5 % of one epoch mostly recur
    top = []
    for b in trace.batches[:2]:
        means = dict(zip(b.prompt_ids.tolist(), b.lengths.mean(axis=1).tolist(), strict=True))
        top.append({p for p, _ in sorted(means.items(), key=lambda kv: -kv[1])[:26]})
    assert len(top[0] & top[1]) >= 13
    with pytest.raises(ValueError, match="clip_ratio"):
        WorkloadConfig(clip_ratio=2.0)
