"""The one elastic policy: knobs declared once, its decisions, its state round trip."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rlhfless.pipeline.config import Config, ConfigError, load_config
from rlhfless.schedulers.migration import WorkerProgress
from rlhfless.schedulers.scaling import choose_generation_workers
from rlhfless.schedulers.scaling_policy import IterationTimings, ScalingKnobs, ScalingPolicy
from rlhfless.schedulers.sim.sim_policy import ELASTIC, PolicyConfig
from rlhfless.schedulers.throughput import ThroughputModel

KNOB_NAMES = [f.name for f in dataclasses.fields(ScalingKnobs)]


def test_live_and_simulated_runs_share_the_knobs_and_their_defaults():
    cfg = Config()
    assert cfg.scaling_knobs() == ScalingKnobs()
    assert ELASTIC.knobs() == ScalingKnobs()  # the simulator's policy, the same defaults
    assert issubclass(PolicyConfig, ScalingKnobs)
    changed = load_config(None, ["tau=0.55", "ewma_alpha=0.25", "keep_alive_s=3"])
    knobs = changed.scaling_knobs()
    assert (knobs.tau, knobs.ewma_alpha, knobs.keep_alive_s) == (0.55, 0.25, 3.0)
    # a simulation of this run's policy takes the run configuration's knobs
    sim = ELASTIC.replace(**dataclasses.asdict(knobs))
    assert sim.knobs() == knobs and sim.migration == ELASTIC.migration


def test_old_key_name_and_bad_values_are_one_line_errors():
    assert load_config(None, ["tau_migrate=0.6"]).tau == 0.6  # a config.json of older runs
    with pytest.raises(ConfigError, match=r"tau = 1.5; allowed: \(0, 1\]"):
        load_config(None, ["tau=1.5"])
    with pytest.raises(ConfigError, match="ewma_alpha = 0"):
        load_config(None, ["ewma_alpha=0"])
    with pytest.raises(ValueError, match=r"PolicyConfig\('x'\): lambda_cost = 2"):
        PolicyConfig("x", lambda_cost=2.0)


def _model() -> ThroughputModel:
    return ThroughputModel(step_intercept_s=0.02, step_slope_s=0.001, prefill_tokens_per_s=1e4,
                           cold_start_s=5.0, max_batch=64)


def test_keep_alive_is_break_even_with_a_restart_unless_set():
    scaling = ScalingPolicy(ScalingKnobs(), _model())
    # no step measured yet: the rest of the step is taken as long as the planned generation
    assert scaling.idle_gap_s(1.5) == 1.5 and scaling.keeps_alive(scaling.idle_gap_s(1.5))
    mean = np.full(16, 200.0)
    planned = scaling.plan(mean, mean, 4, np.full(16, 30.0), keep_warm=1, max_workers=1)
    assert scaling.idle_gap_s(1.5) == pytest.approx(1.5 + planned.predicted_seconds)
    scaling.observe_after_generation(3.0)
    assert scaling.idle_gap_s(1.5) == 4.5 and scaling.idle_gap_s(-2.0) == 3.0
    assert scaling.keep_alive_s() == 5.0  # the throughput model's cold start
    assert scaling.keep_alive_s(restart_s=2.0) == 2.0  # e.g. a wake from host memory
    assert scaling.keeps_alive(4.9) and not scaling.keeps_alive(5.0)
    fixed = ScalingPolicy(ScalingKnobs(keep_alive_s=0.0), _model())
    assert not fixed.keeps_alive(0.0)  # keep-alive 0: released as soon as idle
    long = ScalingPolicy(ScalingKnobs(keep_alive_s=60.0), _model())
    assert long.keeps_alive(long.idle_gap_s(10.0))  # a set keep-alive needs no measurement


def test_after_generation_seconds_are_an_ewma_of_alpha():
    scaling = ScalingPolicy(ScalingKnobs(ewma_alpha=0.5), _model())
    scaling.observe_after_generation(4.0)  # the first observation is taken whole
    scaling.observe_after_generation(2.0)
    assert scaling.update_seconds == pytest.approx(3.0)


def test_plan_honours_bounds_and_lambda():
    scaling = ScalingPolicy(ScalingKnobs(lambda_cost=1.0), _model())
    mean = np.full(16, 200.0)
    fast = scaling.plan(mean, mean, 4, np.full(16, 30.0), keep_warm=8, max_workers=8)
    assert fast.n_workers > 1 and len(fast.assignment) == fast.n_workers
    cheap = ScalingPolicy(ScalingKnobs(lambda_cost=0.0), _model()).plan(
        mean, mean, 4, np.full(16, 30.0), keep_warm=0, max_workers=8)
    assert cheap.n_workers < fast.n_workers
    pinned = scaling.plan(mean, mean, 4, np.full(16, 30.0), keep_warm=0, max_workers=3,
                         min_workers=3)
    assert pinned.n_workers == 3


def test_plan_scores_the_rest_of_the_step_billed_at_rest_workers():
    """One rule for live runs and the simulator: the rest of the step is the policy's own
    ``update_seconds``, billed at ``rest_workers`` generation workers' worth."""
    scaling = ScalingPolicy(ScalingKnobs(lambda_cost=0.5), _model())
    mean, prompts = np.full(16, 200.0), np.full(16, 30.0)
    scaling.observe_after_generation(50.0)
    alone = scaling.plan(mean, mean, 4, prompts, keep_warm=8, max_workers=8)
    expected = choose_generation_workers(mean, 4, scaling.throughput, max_workers=8,
                                         lambda_cost=0.5,
                                         keep_warm=8, pred_max_lengths=mean,
                                         prompt_tokens=prompts, fixed_seconds=50.0,
                                         fixed_cost_ws=50.0 * 8)
    rest = scaling.plan(mean, mean, 4, prompts, keep_warm=8, max_workers=8, rest_workers=8)
    assert rest.n_workers == expected.n_workers
    np.testing.assert_allclose(rest.score, expected.score)
    unscored = choose_generation_workers(mean, 4, scaling.throughput, max_workers=8,
                                         lambda_cost=0.5,
                                         keep_warm=8, pred_max_lengths=mean,
                                         prompt_tokens=prompts)
    np.testing.assert_allclose(alone.score, unscored.score)
    assert not np.allclose(rest.score, alone.score)


def test_migrate_moves_a_paused_tail_not_a_completion_count():
    def progress(done: int, left: int, busy: bool = False) -> dict[str, WorkerProgress]:
        idle = {w: WorkerProgress(0, 0, busy=False) for w in ("b", "c", "d")}
        return {"a": WorkerProgress(done + left, done, [f"s{i}" for i in range(left)],
                                    [100] * left, [1000.0] * left, busy=busy)} | idle

    model = ThroughputModel(step_intercept_s=0.02, step_slope_s=0.005,
                            prefill_tokens_per_s=1e4, cold_start_s=5.0, max_batch=64)
    scaling = ScalingPolicy(ScalingKnobs(tau=0.8, lambda_cost=1.0), model)
    assert scaling.tail_batch() == pytest.approx(2.0)  # 0.02 / (2 * 0.005)
    assert scaling.migrate(progress(95, 3)) == []  # 97 % done, but 3 live > tail batch 2
    assert scaling.migrate(progress(1, 2, busy=True)) == []  # running a chunk: not cut
    moves = scaling.migrate(progress(1, 2))  # 33 % done, a tail of 2: it spreads out, faster
    assert moves and {m.source for m in moves} == {"a"}
    assert {m.target for m in moves} <= {"b", "c", "d"}
    assert all(m.move_seconds < m.stay_seconds for m in moves)


@dataclasses.dataclass
class Shard:  # a generation shard's counters, as GenerationStats carries them
    decode_tokens: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    episodes: Waited | None = None
    weight_fetch_s: float = 0.0


@dataclasses.dataclass
class Waited:  # a multi-turn or agent shard's episode counters, as EpisodeStats has them
    env_wait_seconds: float


def test_one_call_per_iteration_feeds_every_model():
    ids, lengths = ["p1", "p1", "p2"], [10, 14, 30]
    shards = [Shard(160, 10, 0.4, 300, 0.03, Waited(1.5)), Shard()]  # the second: no decode
    timings = IterationTimings(2.5, shards, [4.0, 6.0])
    once = ScalingPolicy(ScalingKnobs(), _model())
    error = once.observe_iteration(ids, lengths, timings)
    assert error["n_unseen"] == 2  # scored before the predictor learned these prompts
    assert once.update_seconds == 2.5 and once.seen_cold_starts == 2
    # the same as each model fed by hand: mean batch 16 over 10 steps of 0.04 s, 300 prompt
    # tokens in 0.03 s, two cold starts; the empty shard adds nothing
    by_hand = ScalingPolicy(ScalingKnobs(), _model())
    by_hand.observe_after_generation(2.5)
    by_hand.observe_decode(16.0, 0.04, n_steps=10)
    by_hand.observe_prefill(300, 0.03)
    by_hand.throughput.observe_env_wait(1.5)
    by_hand.observe_cold_starts([4.0, 6.0])
    by_hand.observe_lengths(ids, lengths)
    assert once.throughput.to_record() == by_hand.throughput.to_record()
    assert once.throughput.to_record() != _model().to_record()
    np.testing.assert_allclose(once.predict(ids), by_hand.predict(ids))
    static = ScalingPolicy(ScalingKnobs(), _model())  # a static pool: lengths only
    static.observe_iteration(ids, lengths)
    assert static.update_seconds == 0 and static.throughput.to_record() == _model().to_record()
    np.testing.assert_allclose(static.predict(ids), once.predict(ids))


def test_the_seconds_episodes_spend_outside_the_model_spread_their_groups():
    scaling = ScalingPolicy(ScalingKnobs(), _model())
    ids = ["long", "waits", "waits too", "short"]
    lengths = [100, 90, 80, 10]
    error = scaling.observe_iteration(ids, lengths, env_seconds=[0.0, 3.0, 3.0, 0.0])
    assert error["n_unseen"] == 4 and error["mae_env"] == pytest.approx(1.5)  # predicted 0
    np.testing.assert_allclose(scaling.predict_env(ids), [0.0, 3.0, 3.0, 0.0])
    pred, pred_max = scaling.predict(ids)
    kw = dict(keep_warm=2, max_workers=2, min_workers=2)
    by_length = scaling.plan(pred, pred_max, 1, np.zeros(4), **kw)
    assert [a.tolist() for a in by_length.assignment] == [[0], [1, 2, 3]]
    spread = scaling.plan(pred, pred_max, 1, np.zeros(4), pred_env=scaling.predict_env(ids),
                          **kw)
    assert [a.tolist() for a in spread.assignment] == [[1], [2, 0, 3]]


def test_state_dict_round_trips_what_the_policy_learned():
    scaling = ScalingPolicy(ScalingKnobs(), _model())
    scaling.observe_lengths(["p1", "p1", "p2"], [10, 14, 30], [0.5, 1.5, 2.0])
    scaling.observe_decode([8.0, 16.0], [0.03, 0.04], [10, 10])
    scaling.observe_after_generation(2.5)
    scaling.observe_cold_starts([4.0, 6.0])
    fresh = ScalingPolicy(ScalingKnobs(), _model())  # the same priors
    fresh.load_state_dict(scaling.state_dict())
    assert fresh.update_seconds == 2.5
    np.testing.assert_allclose(fresh.predict(["p1", "p2", "new"]),
                               scaling.predict(["p1", "p2", "new"]))
    np.testing.assert_allclose(fresh.predict_env(["p1", "p2", "new"]), [1.0, 2.0, 1.5])
    assert fresh.throughput.to_record() == scaling.throughput.to_record()


def test_the_policy_decides_when_an_idle_worker_is_released():
    """Released when its idle gap (the busiest worker's remaining decode, then the rest of
    the step) reaches the keep-alive (here the 5 s cold start), kept otherwise; the decision
    says why. Steps of ~0.02 s: 10 tokens left take ~0.2 s, 1,000 take ~20 s."""
    scaling = ScalingPolicy(ScalingKnobs(), _model())
    scaling.observe_after_generation(3.0)
    assert not scaling.release_idle([]).release  # only the 3 s rest of the step
    short = WorkerProgress(2, 0, ["a#0", "a#1"], [30, 30], [10.0, 10.0], busy=True)
    long = WorkerProgress(2, 0, ["b#0", "b#1"], [30, 30], [1000.0, 1000.0], busy=True)
    kept, released = scaling.release_idle([short]), scaling.release_idle([short, long])
    assert not kept.release and 3.0 < kept.gap_s < 5.0 and "<" in kept.reason
    assert released.release and released.gap_s > 20.0 and released.keep_alive_s == 5.0
    assert released.reason.startswith(f"idle gap {released.gap_s:.2f} s >= keep-alive 5.00 s")
