"""PAT: the pure merge decision by hand-checkable cases, and PAT inside the simulator
(every sample generated once, generation faster than the same static TP)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rlhfless.schedulers.pat import (
    RECONFIG_FIXED_S,
    finish_seconds,
    held_count,
    kv_move_seconds,
    plan_tp,
    reconfig_overhead,
)
from rlhfless.schedulers.profiles import LINK_EFFICIENCY, get_profile
from rlhfless.schedulers.sim.sim_policy import VERL_TUNED
from rlhfless.schedulers.sim.simulator import ClusterConfig, simulate
from rlhfless.schedulers.sim.workloads import LONG_COT, synthetic_trace

BASE = get_profile("Llama3.1-8B@H100")
PROFILES = {t: BASE.variant(tp=t) for t in (1, 2, 4, 8)}


def tails(n_workers: int, n_seqs: int, rem: float, ctx: float) -> list[tuple]:
    return [(np.full(n_seqs, rem), np.full(n_seqs, ctx)) for _ in range(n_workers)]


def test_a_weight_bound_tail_merges_into_a_higher_tp():
    # 8 TP-1 workers with 2 sequences each, 3,000 tokens to go: every step reads all weights
    choice = plan_tp(tails(8, 2, 3000, 4000), PROFILES, 1)
    assert choice.tp > 1 and choice.move_s < choice.stay_s
    assert choice.stay_s - choice.move_s > choice.overhead_s > 0  # the gain pays for it
    groups = np.sort(np.concatenate(choice.groups))
    np.testing.assert_array_equal(groups, np.arange(16))  # every sequence placed once
    assert len(choice.groups) == 8 // (choice.tp // 1)


def test_no_merge_when_the_overhead_exceeds_the_gain():
    # one token left each: nothing to gain, the reconfiguration would only cost
    assert plan_tp(tails(8, 2, 1, 4000), PROFILES, 1).tp == 1
    assert plan_tp(tails(1, 4, 3000, 4000), PROFILES, 1).tp == 1  # one worker: nothing to merge
    with pytest.raises(ValueError, match="has no profile"):
        plan_tp(tails(2, 1, 10, 10), {2: PROFILES[2]}, 1)


def test_kv_moves_by_transfer_or_recompute_by_cost():
    # 4 TP-1 workers, one sequence of 1e5 context tokens each, merged into 2 x TP 2
    ctx, origin, kvb = np.full(4, 1e5), np.arange(4), PROFILES[1].kv_bytes_per_token
    link = BASE.hardware.gpu_link_gbs * 1e9 * LINK_EFFICIENCY
    stay_home = kv_move_seconds(PROFILES[1], PROFILES[2], ctx, origin,
                                (np.array([0, 1]), np.array([2, 3])), [2, 2], 2)
    # each GPU keeps half its heads and ships half, all GPUs at once: one GPU's half
    assert stay_home["transfer"] == pytest.approx(1e5 * kvb / 2 / link)
    assert stay_home["recompute"] == pytest.approx(2e5 / PROFILES[2].prefill_tokens_per_s)
    crossed = kv_move_seconds(PROFILES[1], PROFILES[2], ctx, origin,
                              (np.array([0, 2]), np.array([1, 3])), [2, 2], 2)
    assert crossed["transfer"] == pytest.approx(1e5 * kvb / link)  # dealt away: all of it
    queued = kv_move_seconds(PROFILES[1], PROFILES[2], ctx, origin,
                             (np.array([0, 1]), np.array([2, 3])), [1, 1], 2)
    assert queued["recompute"] == pytest.approx(1e5 / PROFILES[2].prefill_tokens_per_s)
    over, kv = reconfig_overhead(stay_home)
    assert kv == "transfer" and over == pytest.approx(RECONFIG_FIXED_S + stay_home["transfer"])
    assert reconfig_overhead({"transfer": float("inf"), "recompute": 2.0}) == (
        pytest.approx(RECONFIG_FIXED_S + 2.0), "recompute")


def test_a_merge_queues_what_the_new_worker_cannot_hold():
    # 8 TP-1 workers with 8 sequences each; a merged worker's KV cache holds half of its share
    small = {t: p.replace(kv_capacity_tokens=4 * t * 8000) if t > 1 else p
             for t, p in PROFILES.items()}
    rem, ctx = np.full(64, 3000.0), np.full(64, 5000.0)
    assert held_count(small[8], rem, ctx) == 32
    # the queue: twice the steps of one held batch, and the waiting contexts prefilled
    p = small[8]
    expect = (p.step_base_s * 6000 + p.step_per_seq_s * rem.sum()
              + p.step_per_ctx_token_s * np.sum(ctx * rem + rem * (rem - 1) / 2)
              + 32 * 5000 / p.prefill_tokens_per_s)
    assert finish_seconds(p, rem, ctx) == pytest.approx(expect)
    choice = plan_tp(tails(8, 8, 3000, 5000), small, 1)
    assert choice.tp > 1  # queueing half still beats eight weight-bound workers


def test_pat_in_the_simulator_conserves_samples_and_shortens_generation():
    cfg = dataclasses.replace(LONG_COT, dataset_prompts=64, batch_prompts=32, iterations=3,
                              max_response_tokens=4096)
    trace = synthetic_trace(cfg)
    static = simulate(trace, BASE, ClusterConfig(8), VERL_TUNED.replace(tp=1))
    pat = simulate(trace, BASE, ClusterConfig(8), VERL_TUNED.replace(tp=1, pat=True),
                   keep_sequences=True)
    for log, batch in zip(pat.sequences, trace.batches, strict=True):
        assert (log["finished"] == 1).all()
        np.testing.assert_array_equal(log["tokens"], batch.lengths.ravel())
    assert pat.summary()["reconfigurations"] > 0
    assert pat.summary()["gen_s"] < 0.9 * static.summary()["gen_s"]
    assert pat.gpu_seconds() == pytest.approx(8 * pat.t_end)  # reserved: GPUs x lifetime


def test_a_recomputed_kv_cache_is_charged_once():
    # no KV transfer path: every merge recomputes; the recompute is the overhead, so the
    # merged runs prefill nothing more than the static run did (everything fits here)
    cfg = dataclasses.replace(LONG_COT, dataset_prompts=64, batch_prompts=32, iterations=2,
                              max_response_tokens=4096)
    trace = synthetic_trace(cfg)
    no_link = BASE.replace(kv_bytes_per_token=0.0)
    static = simulate(trace, no_link, ClusterConfig(8), VERL_TUNED.replace(tp=1))
    pat = simulate(trace, no_link, ClusterConfig(8), VERL_TUNED.replace(tp=1, pat=True))
    assert pat.summary()["reconfigurations"] > 0
    for s_it, p_it in zip(static.iterations, pat.iterations, strict=True):
        assert p_it.prefill_tokens == pytest.approx(s_it.prefill_tokens)
