"""Transfer-vs-recompute and PAT-on-CPU reconfiguration decisions (``tail_cost.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from rlhfless.schedulers.tail_cost import (
    KvCosts,
    StepProfile,
    TransferModel,
    choose_kv_path,
    latency_bound,
    plan_reconfig,
)
from rlhfless.schedulers.throughput import ThroughputModel


def test_transfer_model_fits_latency_and_bandwidth():
    model = TransferModel()
    for nbytes in (1e6, 4e6, 16e6):
        model.observe(nbytes, 0.02 + nbytes / 1e8)
    assert model.latency_s == pytest.approx(0.02) and model.bytes_per_s == pytest.approx(1e8)
    assert model.seconds(5e7) == pytest.approx(0.52)


def test_choice_follows_the_fitted_rates():
    transfer, throughput = TransferModel(), ThroughputModel()
    transfer.observe(1e6, 0.05)
    transfer.observe(1e7, 0.14)  # 1e8 B/s, 40 ms latency
    throughput.observe_prefill(1000, 0.1)  # 10k tokens/s
    # a small context: recomputing 100 tokens (10 ms) beats 40 ms of latency
    assert choose_kv_path(100, 200_000, transfer, throughput).path == "recompute"
    # a long context: 5000 tokens take 0.5 s to recompute, their 10 MB 0.14 s to send
    big = choose_kv_path(5000, 10_000_000, transfer, throughput)
    assert big.path == "transfer" and big.predicted_s == pytest.approx(0.14)


def _samples(seconds: float, spread: float, threads: int) -> list[float]:
    """Three samples ``spread`` apart (relative), in the first repeat low on 1 thread and
    high on 2, in the last the other way round: repeats that disagree."""
    low_high = [seconds * (1 - spread), seconds, seconds * (1 + spread)]
    return low_high if threads == 1 else low_high[::-1]


def _profile(speedup: float, spread: float = 0.0) -> StepProfile:
    """1 thread: 10 ms + 1 ms per sequence; 2 threads: ``speedup`` times faster; three
    samples per point, ``spread`` apart (relative)."""
    one = {(b, 1): 0.010 + 0.001 * b for b in (1, 4, 16)}
    means = one | {(b, 2): s / speedup for (b, _), s in one.items()}
    return StepProfile({k: _samples(s, spread, k[1]) for k, s in means.items()})


TAILS = {"a": [40, 35, 30, 5], "b": [38, 20, 10]}


def test_reconfiguration_fires_when_wider_pays_more_than_it_costs():
    choice = plan_reconfig(TAILS, {"a": 1, "b": 1}, _profile(1.8), {"a": 0.05, "b": 0.08})
    assert choice.fire and choice.target == "a" and choice.threads == 2
    assert choice.move_s < choice.stay_s


def test_reconfiguration_stays_when_threads_do_not_pay_or_moving_costs_too_much():
    assert not plan_reconfig(TAILS, {"a": 1, "b": 1}, _profile(1.0), {"a": 0.0, "b": 0.0}).fire
    assert not plan_reconfig(TAILS, {"a": 1, "b": 1}, _profile(1.8), {"a": 5.0, "b": 5.0}).fire
    lone = plan_reconfig({"a": [3, 2], "b": []}, {"a": 1, "b": 1}, _profile(2.0),
                         {"a": 0.0, "b": 0.0})
    assert not lone.fire  # one live worker: nothing to consolidate


def test_a_gain_inside_the_profile_noise_does_not_fire():
    """A 1.25x thread speedup pays when measured cleanly, not when its samples spread +-30 %:
    a repeat of the profile then says staying is sooner; the decision must not flip on
    noise."""
    overhead = {"a": 0.0, "b": 0.0}
    clean, noisy = _profile(1.25, spread=0.02), _profile(1.25, spread=0.3)
    assert clean.speedup(4, 2) == pytest.approx(noisy.speedup(4, 2))  # same medians
    assert noisy.noise == pytest.approx(0.3) and clean.noise == pytest.approx(0.02)
    assert plan_reconfig(TAILS, {"a": 1, "b": 1}, clean, overhead).fire
    quiet = plan_reconfig(TAILS, {"a": 1, "b": 1}, noisy, overhead)
    assert not quiet.fire and quiet.move_s < quiet.stay_s
    assert "sooner in 2 of 3 repeats" in quiet.reason


def test_consolidation_speedup_charges_the_doubled_batch():
    """Two threads 1.8x faster at the same batch; consolidating two tails of 4 doubles the
    batch: (10 + 4) ms against (10 + 8) / 1.8 ms, 1.4x."""
    profile = _profile(1.8)
    assert profile.speedup(4, 2) == pytest.approx(1.8)
    assert profile.consolidation_speedup(4, 2) == pytest.approx(0.014 * 1.8 / 0.018)


# A measured profile of the 200M-parameter ``wide`` model (bench/tail.py, 24 prompts): step
# medians at batch 1 / 8 / 16 on 1 thread (both workers at once) and 2 threads (one alone),
# samples +-9 %. Not linear in the batch: steps at 8 and 16 cost nearly the same.
WIDE_MS = {1: (50, 47), 8: (175, 150), 16: (213, 171)}


def _wide_profile(spread: float = 0.09) -> StepProfile:
    return StepProfile({(b, t + 1): _samples(ms[t] * 1e-3, spread, t + 1)
                        for b, ms in WIDE_MS.items() for t in (0, 1)})


def _linear_fit_seconds(profile: StepProfile, remaining: list[float], threads: int) -> float:
    """The rule this profile's decision replaced: ``a_t * max r + c_t * sum r`` of the least
    squares line through the medians."""
    c, a = np.polyfit(*profile.points[threads], 1)
    return a * max(remaining) + c * sum(remaining)


def test_step_times_are_the_measured_points_interpolated_and_extrapolated_flat_or_up():
    profile = _wide_profile()
    assert profile.step_seconds(8, 1) == pytest.approx(0.175)
    assert profile.step_seconds(4, 1) == pytest.approx(0.050 + 3 * 0.125 / 7)
    assert profile.largest_batch(2) == 16
    assert profile.step_seconds(24, 2) == pytest.approx(0.171 + 8 * 0.021 / 8)
    falling = StepProfile({(1, 1): [0.05], (8, 1): [0.30], (16, 1): [0.29]})
    assert falling.step_seconds(32, 1) == pytest.approx(0.29)  # never extrapolated downwards
    # continuous batching: 3 steps at batch 2, then 2 at batch 1
    assert profile.decode_seconds([5, 3], 1) == pytest.approx(
        3 * profile.step_seconds(2, 1) + 2 * 0.050)


def test_a_linear_fit_credits_threads_the_measured_points_do_not():
    """One worker's seven tails and the other's one: the fit's slope (2 threads 1.32x per
    sequence) says consolidating gains 10 %; the measured steps at batch 7-8 (157-175 ms on
    1 thread, 150 ms on 2) say 8 %, which the first repeat (1 thread 9 % low, 2 threads 9 %
    high) does not show: it stays."""
    profile, tails = _wide_profile(), {"a": [36, 36, 36, 26, 26, 16, 11], "b": [16]}
    fit_stay = max(_linear_fit_seconds(profile, r, 1) for r in tails.values())
    fit_move = _linear_fit_seconds(profile, tails["a"] + tails["b"], 2)
    assert fit_move < fit_stay * (1 - profile.noise)  # the fit would fire, margin or not
    plan = plan_reconfig(tails, {"a": 1, "b": 1}, profile, {"a": 0.0, "b": 0.0})
    assert not plan.fire and plan.move_s > plan.stay_s * (1 - profile.noise)
    assert "sooner in 2 of 3 repeats" in plan.reason
    assert "extrapolated" not in plan.reason  # every batch within the measured 16


def test_reconfiguration_fires_where_the_measured_points_pay():
    """Twelve tails of 30 tokens on one worker, one of 5 on the other: 2 threads at batch
    12-13 (161-166 ms) against 1 thread at 12 (194 ms), 17 % sooner: by every repeat too
    when the samples spread +-5 % (at +-9 % the first repeat says 5.30 s against 5.33 s)."""
    profile = _wide_profile(0.05)
    plan = plan_reconfig({"a": [30] * 12, "b": [5]}, {"a": 1, "b": 1}, profile,
                         {"a": 0.07, "b": 0.07})
    assert plan.fire and plan.threads == 2
    assert plan.stay_s == pytest.approx(30 * profile.step_seconds(12, 1))
    assert plan.move_s == pytest.approx(0.07 + 5 * profile.step_seconds(13, 2)
                                        + 25 * profile.step_seconds(12, 2))
    wider = plan_reconfig({"a": [30] * 16, "b": [5] * 4}, {"a": 1, "b": 1}, profile,
                          {"a": 0.07, "b": 0.07})
    assert "extrapolated batch 20 on 2 thread(s), largest measured 16" in wider.reason


# ``wide`` decoding in float64 (a one-process timing of the decode loop, 8 steps, quiet): step
# ms at batch 1 / 2 / 4 / 8 / 16 on 1 and 2 threads. One sequence is a matrix-vector product;
# from two on, a matrix product that a second thread speeds up 1.3-1.8x.
WIDE64_MS = {1: (67, 64), 2: (133, 107), 4: (176, 103), 8: (231, 128), 16: (299, 166)}


def _wide64_profile(batches) -> StepProfile:
    return StepProfile({(b, t + 1): _samples(WIDE64_MS[b][t] * 1e-3, 0.05, t + 1)
                        for b in batches for t in (0, 1)})


def test_sparse_profile_points_misjudge_a_tail_of_a_few_sequences():
    """Three sequences of 20 tokens on each worker: measured, 1 thread at batch 3 costs
    155 ms a step and 2 threads at batch 6 116 ms, consolidating 25 % sooner; points at 1, 8,
    16 only interpolate 114 ms against 110 ms (4 %, inside the samples' +-5 %): it would
    stay."""
    tails, threads, free = {"a": [20] * 3, "b": [20] * 3}, {"a": 1, "b": 1}, {"a": 0, "b": 0}
    dense = plan_reconfig(tails, threads, _wide64_profile((1, 2, 4, 8, 16)), free)
    sparse = plan_reconfig(tails, threads, _wide64_profile((1, 8, 16)), free)
    assert dense.fire and dense.move_s == pytest.approx(20 * 0.1155)
    assert dense.stay_s == pytest.approx(20 * 0.1545)
    assert not sparse.fire and sparse.move_s > sparse.stay_s * 0.95


def test_latency_bound_times_static_balanced_and_the_longest_chain():
    lengths = {"a": [40, 10], "b": [5, 5]}
    bound = latency_bound(_profile(1.0), lengths)
    # worker a: 10 steps at batch 2, 30 at 1; balanced: 4 live (2 each) for 5 steps, then 1
    assert bound["static_s"] == pytest.approx(10 * 0.012 + 30 * 0.011)
    assert bound["balanced_s"] == pytest.approx(5 * 0.012 + 35 * 0.011)
    assert bound["chain_s"] == pytest.approx(0.011 * 40) and bound["longest"] == 40
    assert bound["tokens"] == 60
    # two threads twice as fast: the longest response alone runs at half the time
    assert latency_bound(_profile(2.0), lengths)["chain_s"] == pytest.approx(0.011 * 40 / 2)
    # many short responses: 150 a worker, balanced, against 200 on one
    many = latency_bound(_profile(1.0), {"a": [10] * 200, "b": [10] * 100})
    assert many["static_s"] == pytest.approx(10 * 0.210)
    assert many["balanced_s"] == pytest.approx(10 * 0.160)
    # a step time nearly flat from 4 to 16: spreading 8 long responses over 2 workers gains
    # 4 %: 8 live a worker at 0.20 s a step for 5 steps, then 4 at 0.19 against 8 at 0.20
    flat = StepProfile({(1, 1): [0.05], (4, 1): [0.19], (16, 1): [0.22]})
    same = latency_bound(flat, {"a": [40] * 8, "b": [5] * 8})
    assert same["static_s"] == pytest.approx(40 * 0.20)  # a: 8 live for 40 steps
    assert same["balanced_s"] == pytest.approx(5 * 0.20 + 35 * 0.19)
    with pytest.raises(ValueError, match="no sequences"):
        latency_bound(_profile(1.0), {"a": []})


def test_profile_needs_two_batch_sizes_per_thread_count_and_samples():
    with pytest.raises(ValueError, match="two batch sizes"):
        StepProfile({(1, 1): [0.01], (1, 2): [0.008]})
    with pytest.raises(ValueError, match="positive samples"):
        StepProfile({(1, 1): [], (4, 1): [0.01]})


def test_kv_costs_learn_from_moves_and_round_trip():
    throughput = ThroughputModel()
    costs = KvCosts(throughput, TransferModel(prior_latency_s=0.0), kv_bytes_per_token=None)
    assert costs.seconds_per_token() is None  # bytes unknown: planning recomputes
    assert costs.choose(1000).path == "transfer"  # zero latency, zero bytes assumed
    costs.observe("transfer", 1000, 4_000_000, 0.5)  # 4 kB per token, slow
    costs.observe("transfer", 500, 2_000_000, 0.3)
    assert costs.kv_bytes_per_token == 4000.0
    assert costs.transfer.seconds(4_000_000) == pytest.approx(0.5)
    costs.observe("recompute", 10_000, 0, 0.1)  # 100k tokens/s, on the shared model
    assert throughput.prefill_tokens_per_s == pytest.approx(1e5)
    choice = costs.choose(1000)
    assert choice.path == "recompute" and choice.recompute_s == pytest.approx(0.01)
    assert costs.seconds_per_token() == pytest.approx(4000 / costs.transfer.bytes_per_s)
    fresh = KvCosts(ThroughputModel())
    fresh.load_state_dict(costs.state_dict())
    assert fresh.state_dict() == costs.state_dict()
    with pytest.raises(ValueError, match="path"):
        costs.observe("teleport", 1, 1, 1.0)
