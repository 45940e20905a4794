"""ThroughputModel: closed form vs a step-by-step simulation, online fits, state round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfless.schedulers.throughput import ThroughputModel


def simulate_steps(lengths: list[int], a: float, c: float, cap: int | None) -> float:
    """Continuous batching step by step: FCFS admission into at most ``cap`` slots."""
    queue = list(lengths)
    live: list[int] = []
    seconds = 0.0
    while queue or live:
        while queue and (cap is None or len(live) < cap):
            live.append(queue.pop(0))
        seconds += a + c * len(live)
        live = [n - 1 for n in live if n > 1]
    return seconds


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=30))
def test_closed_form_equals_step_loop_without_cap(lengths):
    model = ThroughputModel(step_intercept_s=0.03, step_slope_s=0.002, prefill_tokens_per_s=1000)
    got = model.predict_worker_seconds(np.array(lengths), prompt_tokens=500)
    assert got == pytest.approx(0.5 + simulate_steps(lengths, 0.03, 0.002, None))


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=1, max_size=40), cap=st.integers(1, 8))
def test_with_a_batch_cap_the_closed_form_is_a_tight_lower_bound(lengths, cap):
    a, c = 0.03, 0.002
    model = ThroughputModel(step_intercept_s=a, step_slope_s=c, max_batch=cap)
    got = model.predict_worker_seconds(np.array(lengths), prompt_tokens=0)
    exact = simulate_steps(lengths, a, c, cap)
    assert got <= exact + 1e-9
    assert exact <= got + a * max(lengths) + 1e-9


def test_hand_checked_worker_seconds():
    model = ThroughputModel(step_intercept_s=0.01, step_slope_s=0.001, prefill_tokens_per_s=100)
    # prefill 200/100 = 2 s; decode 0.01 * 30 + 0.001 * (10 + 20 + 30) = 0.36 s
    assert model.predict_worker_seconds(np.array([10, 20, 30]), 200) == pytest.approx(2.36)
    assert model.predict_worker_seconds(np.array([]), 200) == pytest.approx(2.0)


def test_decode_fit_recovers_the_line_and_chunks_are_exact():
    model = ThroughputModel()
    b = np.array([1, 8, 32, 64, 128, 256])
    model.observe_decode(b, 0.015 + 0.0002 * b)
    assert model.step_intercept_s == pytest.approx(0.015)
    assert model.step_slope_s == pytest.approx(0.0002)
    chunked = ThroughputModel()
    # chunks of k steps at mean batch b taking k * t_step(b) seconds, given as weights
    chunked.observe_decode([4, 100], [0.015 + 0.0008, 0.015 + 0.02], n_steps=[50, 7])
    assert chunked.t_step(10) == pytest.approx(0.015 + 0.002)


def test_decode_fit_falls_back_sensibly():
    one = ThroughputModel(step_intercept_s=0.02, step_slope_s=0.001)
    one.observe_decode([16, 16], [0.05, 0.07])  # one batch size: keep prior slope
    assert one.step_slope_s == 0.001 and one.step_intercept_s == pytest.approx(0.06 - 0.016)
    falling = ThroughputModel()
    falling.observe_decode([1, 100], [0.05, 0.04])  # negative slope is not physical
    assert falling.step_slope_s == 0.0 and falling.step_intercept_s == pytest.approx(0.045)
    window = ThroughputModel(window=4)
    window.observe_decode(np.arange(1, 11), np.full(10, 0.1))
    assert window.to_record()["n_decode_obs"] == 4


def test_prefill_rate_and_cold_start_ewma():
    model = ThroughputModel(prefill_tokens_per_s=1e4, cold_start_s=30.0, cold_start_alpha=0.3)
    assert model.prefill_tokens_per_s == 1e4 and model.cold_start_s == 30.0
    model.observe_prefill([1000, 3000], [0.5, 1.5])
    assert model.prefill_tokens_per_s == pytest.approx(2000.0)
    model.observe_cold_start(10.0)  # the first measurement replaces the prior
    assert model.cold_start_s == 10.0
    model.observe_cold_start(20.0)
    assert model.cold_start_s == pytest.approx(0.3 * 20 + 0.7 * 10)


def test_the_wait_on_environments_is_an_ewma_from_zero():
    model = ThroughputModel(cold_start_alpha=0.3)
    assert model.env_wait_s == 0.0  # nothing waited for until a shard says so
    model.observe_env_wait(4.0)  # the first measurement is taken whole
    model.observe_env_wait(2.0)
    assert model.env_wait_s == pytest.approx(0.3 * 2 + 0.7 * 4)
    with pytest.raises(ValueError, match="finite and >= 0"):
        model.observe_env_wait(-1.0)


def test_state_dict_round_trips_through_json():
    model = ThroughputModel()
    model.observe_decode([2, 40, 90], [0.02, 0.03, 0.05])
    model.observe_prefill(5000, 0.4)
    model.observe_cold_start(12.5)
    model.observe_env_wait(3.0)
    other = ThroughputModel()
    other.load_state_dict(json.loads(json.dumps(model.state_dict())))
    assert other.to_record() == model.to_record() and other.env_wait_s == 3.0
    older = {k: v for k, v in model.state_dict().items() if "env_wait" not in k}
    other.load_state_dict(older)  # a checkpoint of an older run: no wait seen
    assert other.env_wait_s == 0.0
    with pytest.raises(ValueError, match="lacks keys"):
        other.load_state_dict({"version": 1})


def test_bad_inputs_say_what_is_allowed():
    with pytest.raises(ValueError, match="max_batch"):
        ThroughputModel(max_batch=0)
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        ThroughputModel(prefill_tokens_per_s=0)
    with pytest.raises(ValueError, match="expected 2 values"):
        ThroughputModel().observe_decode([1, 2], [0.1])
    with pytest.raises(ValueError, match=">= 0"):
        ThroughputModel().observe_prefill([-1], [1.0])
