"""LengthPredictor: EWMA values by hand, fallback for unseen prompts, error, state round trip;
the same for the episodes' seconds outside the model."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfless.schedulers.predictor import LengthPredictor, remaining_tokens


def test_ewma_of_group_mean_and_max_by_hand():
    p = LengthPredictor(alpha=0.5)
    p.observe(["a", "a", "b"], [100, 200, 50])  # a: mean 150 max 200; b: 50 / 50
    np.testing.assert_allclose(p.predict(["a", "b"]), [150.0, 50.0])
    np.testing.assert_allclose(p.predict_max(["a", "b"]), [200.0, 50.0])
    p.observe(["a", "a"], [300, 300])  # a: 0.5*300 + 0.5*150 = 225; max 0.5*300 + 0.5*200
    np.testing.assert_allclose(p.predict(["a", "b"]), [225.0, 50.0])
    np.testing.assert_allclose(p.predict_max(["a"]), [250.0])
    assert len(p) == 2


def test_alpha_one_keeps_last_epoch_only():
    p = LengthPredictor(alpha=1.0)
    p.observe(["x"], [10])
    p.observe(["x"], [70])
    assert p.predict(["x"])[0] == 70.0


def test_unseen_prompts_fall_back_to_default_then_recent_quantile():
    p = LengthPredictor(fallback_quantile=0.5, default_length=128.0, window=3)
    np.testing.assert_allclose(p.predict(["new"]), [128.0])
    np.testing.assert_allclose(p.predict_max(["new"]), [128.0])
    p.observe(["a", "a", "b", "c"], [100, 300, 400, 600])  # means 200, 400, 600
    np.testing.assert_allclose(p.predict(["new", "a"]), [400.0, 200.0])
    np.testing.assert_allclose(p.predict_max(["new"]), [400.0])  # maxes 300, 400, 600
    p.observe(["d"], [1000])  # the window keeps the last 3 per-prompt observations
    np.testing.assert_allclose(p.predict(["new"]), [600.0])


def test_seconds_outside_the_model_are_an_ewma_per_prompt_with_a_recent_fallback():
    p = LengthPredictor(alpha=0.5, window=3)
    np.testing.assert_allclose(p.predict_env(["new"]), [0.0])  # nothing observed: 0 s
    p.observe(["a", "a", "b"], [10, 20, 30], env_seconds=[1.0, 3.0, 8.0])  # a: 2 s, b: 8 s
    np.testing.assert_allclose(p.predict_env(["a", "b"]), [2.0, 8.0])
    p.observe(["a", "c"], [10, 10], env_seconds=[6.0, 5.0])  # a: 0.5*6 + 0.5*2 = 4
    np.testing.assert_allclose(p.predict_env(["a", "c"]), [4.0, 5.0])
    # an unseen prompt: the median of the last 3 per-prompt observations (8, 6, 5)
    np.testing.assert_allclose(p.predict_env(["new"]), [6.0])
    np.testing.assert_allclose(p.predict(["a"]), [12.5])  # lengths learned as before
    p.observe(["a"], [10])  # no environment: 0 s
    np.testing.assert_allclose(p.predict_env(["a"]), [2.0])
    with pytest.raises(ValueError, match="env_seconds value at position 0"):
        p.observe(["a"], [10], env_seconds=[-1.0])


def test_error_scores_the_seconds_outside_the_model_when_given():
    p = LengthPredictor(alpha=0.5)
    p.observe(["a", "b"], [100, 200], env_seconds=[2.0, 0.5])
    err = p.error(["a", "a", "b"], [100, 100, 200], env_seconds=[3.0, 5.0, 0.0])
    assert err["mae_env"] == pytest.approx((2 + 0.5) / 2)  # actual means a=4, b=0
    assert err["bias_env"] == pytest.approx((-2 + 0.5) / 2)
    assert err["mape_env"] == pytest.approx((2 / 4 + 0.5 / 1) / 2)
    assert not any(k.endswith("_env") for k in p.error(["a"], [100]))
    assert p.error([], [], env_seconds=[])["mae_env"] is None


def test_error_scores_the_prediction_made_before_observing():
    p = LengthPredictor(alpha=0.5)
    p.observe(["a", "b"], [100, 200])
    err = p.error(["a", "a", "b"], [150, 250, 100])  # actual means a=200, b=100
    assert err["n_prompts"] == 2 and err["n_samples"] == 3 and err["n_unseen"] == 0
    assert err["mae"] == pytest.approx((100 + 100) / 2)
    assert err["mape"] == pytest.approx((100 / 200 + 100 / 100) / 2)
    assert err["bias"] == pytest.approx((-100 + 100) / 2)
    assert err["mae_max"] == pytest.approx((150 + 100) / 2)  # actual maxes 250, 100
    json.dumps(err)
    np.testing.assert_allclose(p.predict(["a"]), [100.0])  # error() did not observe
    assert p.error([], [])["mae"] is None


def test_state_dict_round_trips_through_json():
    p = LengthPredictor(alpha=0.3, window=5)
    for it in range(3):
        p.observe([f"p{i}" for i in range(8) for _ in range(2)], np.arange(16) * (it + 1),
                  env_seconds=np.arange(16) * 0.5 / (it + 1))
    q = LengthPredictor(alpha=0.3, window=5)
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    ids = [f"p{i}" for i in range(10)]
    np.testing.assert_allclose(q.predict(ids), p.predict(ids))
    np.testing.assert_allclose(q.predict_max(ids), p.predict_max(ids))
    np.testing.assert_allclose(q.predict_env(ids), p.predict_env(ids))


def test_a_state_written_before_seconds_outside_the_model_loads():
    p = LengthPredictor()
    p.observe(["a", "b"], [100, 300])
    old = {k: v for k, v in p.state_dict().items() if k not in ("env", "recent_env")}
    q = LengthPredictor()
    q.load_state_dict(old | {"version": 1})
    np.testing.assert_allclose(q.predict(["a", "b", "new"]), p.predict(["a", "b", "new"]))
    np.testing.assert_allclose(q.predict_env(["a", "new"]), [0.0, 0.0])
    q.observe(["new"], [50], env_seconds=[4.0])
    np.testing.assert_allclose(q.predict_env(["new", "unseen"]), [4.0, 4.0])
    assert q.state_dict()["version"] == 2


def test_load_state_dict_names_what_is_wrong():
    state = LengthPredictor().state_dict()
    with pytest.raises(ValueError, match="lacks keys"):
        LengthPredictor().load_state_dict({"version": 1})
    with pytest.raises(ValueError, match="must be equal"):
        LengthPredictor().load_state_dict({**state, "prompt_ids": ["a"]})
    with pytest.raises(ValueError, match=r"lacks keys \['env', 'recent_env'\]"):
        LengthPredictor().load_state_dict({k: v for k, v in state.items()
                                           if k not in ("env", "recent_env")})
    with pytest.raises(ValueError, match="this code reads 1 and 2"):
        LengthPredictor().load_state_dict({**state, "version": 3})


@pytest.mark.parametrize(
    "kwargs, match",
    [({"alpha": 0.0}, "alpha"), ({"fallback_quantile": 2}, "fallback_quantile"),
     ({"window": 0}, "window"), ({"default_length": -1}, "default_length")],
)
def test_bad_config_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LengthPredictor(**kwargs)


def test_bad_lengths_name_the_position():
    p = LengthPredictor()
    with pytest.raises(ValueError, match="one length per sample"):
        p.observe(["a", "b"], [1])
    with pytest.raises(ValueError, match="position 1 .prompt 'b'"):
        p.observe(["a", "b"], [1, -5])


def test_hundred_thousand_prompts_are_handled_vectorised():
    rng = np.random.default_rng(0)
    ids = [f"q{i}" for i in range(100_000)]
    samples = [p for p in ids for _ in range(4)]
    lengths = rng.integers(1, 4000, len(samples))
    p = LengthPredictor(alpha=0.5)
    p.observe(samples, lengths)
    p.observe(samples, lengths * 2)
    pred = p.predict(ids[:5] + ["unseen"])
    expect = 0.5 * lengths[:20].reshape(5, 4).mean(1) * 2 + 0.5 * lengths[:20].reshape(5, 4).mean(1)
    np.testing.assert_allclose(pred[:5], expect)
    assert len(p) == 100_000


@settings(max_examples=50, deadline=None)
@given(
    alpha=st.floats(0.05, 1.0),
    rounds=st.lists(
        st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 500)), min_size=1, max_size=12),
        min_size=1, max_size=5,
    ),
)
def test_matches_a_plain_python_reference(alpha, rounds):
    p = LengthPredictor(alpha=alpha)
    ref_mean: dict[str, float] = {}
    ref_max: dict[str, float] = {}
    for obs in rounds:
        ids, lengths = zip(*obs, strict=True)
        p.observe(list(ids), list(lengths))
        for key in set(ids):
            vals = [v for k, v in obs if k == key]
            for ref, x in ((ref_mean, sum(vals) / len(vals)), (ref_max, max(vals))):
                ref[key] = x if key not in ref else alpha * x + (1 - alpha) * ref[key]
    keys = sorted(ref_mean)
    np.testing.assert_allclose(p.predict(keys), [ref_mean[k] for k in keys], atol=1e-9)
    np.testing.assert_allclose(p.predict_max(keys), [ref_max[k] for k in keys], atol=1e-9)


def test_remaining_tokens_are_conditioned_on_what_was_generated():
    rem = remaining_tokens([300, 300, 300, 300], [100, 299, 400, 1900], cap=2048)
    # ahead of the prediction: the rest of it; past it: as many again, within the cap
    np.testing.assert_array_equal(rem, [200, 1, 400, 148])
    assert remaining_tokens(10, 10)[()] == 10.0
