"""PAT: the pure merge decision by hand-checkable cases, and PAT inside the simulator
(every sample generated once, generation faster than the same static TP)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rlhfless.schedulers.pat import plan_tp, reconfig_overhead
from rlhfless.schedulers.profiles import get_profile
from rlhfless.schedulers.sim_policy import VERL_TUNED
from rlhfless.schedulers.simulator import ClusterConfig, simulate
from rlhfless.schedulers.workloads import LONG_COT, synthetic_trace

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
    over, kv = reconfig_overhead(PROFILES[1], PROFILES[2], 1e5, 0.5)
    assert kv == "transfer"  # NVLink ships the KV faster than a prefill recomputes it
    slow_hw = dataclasses.replace(BASE.hardware, gpu_link_gbs=1e-3)
    slow = PROFILES[1].replace(hardware=slow_hw)
    over_slow, kv_slow = reconfig_overhead(slow, PROFILES[2], 1e5, 0.5)
    assert kv_slow == "recompute" and over_slow == pytest.approx(
        0.3 + 1e5 / PROFILES[2].prefill_tokens_per_s)
    assert over < over_slow


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
