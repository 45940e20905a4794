"""``tail_split.plan_split``: shedding the heaviest worker's tail, checked by hand on a
linear step profile (one thread: 0.008 s + 0.002 s per live sequence)."""

from __future__ import annotations

import pytest

from rlhfless.schedulers.tail_cost import StepProfile
from rlhfless.schedulers.tail_split import plan_split

LINEAR = StepProfile({(1, 1): [0.010], (8, 1): [0.024]})
ONE = {"a": 1, "b": 1}


def step(batch: int) -> float:
    return 0.008 + 0.002 * batch


def test_an_idle_worker_takes_half_of_an_even_tail():
    plan = plan_split({"a": [10.0] * 8}, {"a": [30] * 8}, ONE, LINEAR, lambda t: 0.0)
    assert plan.fire
    (move,) = plan.moves
    assert (move.source, move.target) == ("a", "b")
    assert len(move.positions) == 4 and move.context_tokens == 4 * 30
    assert plan.stay_s == pytest.approx(10 * step(8))
    assert plan.split_s == pytest.approx(10 * step(4))
    assert plan.finish_s == pytest.approx({"a": 10 * step(4), "b": 10 * step(4)})


def test_landing_the_context_is_charged_to_the_target():
    plan = plan_split({"a": [10.0] * 8}, {"a": [30] * 8}, ONE, LINEAR, lambda t: 0.0004 * t)
    b = [m for m in plan.moves if m.target == "b"]
    (move,) = b
    n = len(move.positions)
    assert plan.finish_s["b"] == pytest.approx(0.0004 * 30 * n + 10 * step(n))
    assert n == 3  # a fourth would land b after a (0.048 + 0.16 > 0.18)
    assert plan.split_s == pytest.approx(max(10 * step(5), 0.036 + 10 * step(3)))


def test_the_longest_sequence_moves_when_its_batch_sets_the_finish():
    tails = {"a": [40.0, 5.0, 5.0, 5.0], "b": [5.0, 5.0]}
    plan = plan_split(tails, {"a": [10] * 4, "b": [10] * 2}, ONE, LINEAR, lambda t: 0.0)
    (move,) = plan.moves  # a: 5 steps of 4 + 35 of 1; moved, the 40 runs with b's two
    assert move.positions == (0,) and plan.fire
    assert plan.stay_s == pytest.approx(5 * step(4) + 35 * step(1))
    assert plan.split_s == pytest.approx(5 * step(3) + 35 * step(1))


def test_one_sequence_alone_is_not_split():
    plan = plan_split({"a": [40.0]}, {"a": [10]}, ONE, LINEAR, lambda t: 0.0)
    assert not plan.fire and plan.moves == () and plan.split_s == plan.stay_s


def test_a_costly_move_or_a_repeat_that_disagrees_stays():
    costly = plan_split({"a": [10.0] * 8}, {"a": [30] * 8}, ONE, LINEAR, lambda t: 1.0)
    assert not costly.fire and costly.moves == ()
    # the medians are LINEAR's, but the third repeat measured a flat step: no gain there
    flat_once = StepProfile({(1, 1): [0.010, 0.010, 0.024], (8, 1): [0.024] * 3})
    plan = plan_split({"a": [10.0] * 8}, {"a": [30] * 8}, ONE, flat_once, lambda t: 0.0)
    assert not plan.fire and plan.split_s == plan.stay_s
    assert "sooner in 2 of 3 repeats" in plan.reason and plan.reason.startswith("stay")


def test_nothing_moves_twice_over_three_workers():
    tails = {"a": [30.0, 20.0, 20.0, 10.0, 10.0, 10.0, 5.0, 5.0], "b": [12.0, 3.0], "c": []}
    ctx = {w: [20] * len(r) for w, r in tails.items()}
    plan = plan_split(tails, ctx, {"a": 1, "b": 1, "c": 1}, LINEAR, lambda t: 0.0)
    assert plan.fire and plan.split_s < plan.stay_s
    sources = {m.source for m in plan.moves}
    assert sources.isdisjoint({m.target for m in plan.moves})
    for m in plan.moves:
        assert len(set(m.positions)) == len(m.positions)
        assert all(0 <= p < len(tails[m.source]) for p in m.positions)
    shed = [(m.source, p) for m in plan.moves for p in m.positions]
    assert len(shed) == len(set(shed))
    record = plan.to_record()
    assert record["fire"] and record["moves"][0]["positions"] == list(plan.moves[0].positions)
