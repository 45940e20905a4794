"""``choose_tail``: each action where the step profile says it finishes the pool soonest, stay
where nothing does, refusals of what the engine cannot do, forced actions.

The profiles are built so that the answer follows from arithmetic on them (noise-free: five
equal samples per point): ``decode_seconds`` of ``n`` sequences with ``r`` tokens left each
is ``r`` steps at the step time of batch ``n``."""

from __future__ import annotations

import pytest

from rlhfless.schedulers.migration import Migration
from rlhfless.schedulers.tail_choice import Tail, choose_tail
from rlhfless.schedulers.tail_cost import StepProfile

BATCHES = (1, 2, 4, 8, 16)
ALL = frozenset({"stay", "kv", "recompute", "split", "reconfig"})


def profile(one, two) -> StepProfile:
    """Step seconds by batch on 1 thread (``one(b)``) and on 2 threads (``two(b)``)."""
    return StepProfile({(b, t): [f(b)] * 5 for b in BATCHES for t, f in ((1, one), (2, two))})


def tails(**lists) -> dict[str, Tail]:
    """Per worker: each sequence's remaining tokens; 100 context tokens each."""
    return {w: Tail(tuple(f"{w}{i}" for i in range(len(r))), tuple(map(float, r)),
                    (100,) * len(r)) for w, r in lists.items()}


def move_s(tokens: int) -> float:
    return 0.001 * tokens  # 0.1 s per moved sequence's context


THREADS = {"a": 1, "b": 1}


def test_reconfiguration_when_two_threads_halve_the_step():
    """Stay: 50 steps at batch 4 on 1 thread, 0.14 s = 7.0 s. Consolidated: 50 steps at
    batch 8 on 2 threads, 0.09 s = 4.5 s, + 0.4 s landing the other tail = 4.9 s."""
    p = profile(lambda b: 0.1 + 0.01 * b, lambda b: 0.05 + 0.005 * b)
    choice = choose_tail(tails(a=[50] * 4, b=[50] * 4), [], THREADS, p, ALL, [], move_s)
    assert choice.action == "reconfig" and choice.reconfig.threads == 2
    assert choice.stay_s == pytest.approx(7.0) and choice.predicted_s == pytest.approx(4.9)
    assert "refused" not in choice.options["split"] and not choice.options["split"]["fire"]


def test_split_when_one_worker_holds_the_long_tail():
    """A step costs 0.01 s per live sequence, threads or not: stay 100 steps x 0.06 = 6 s
    on ``a``; shedding long sequences to ``b`` finishes both sooner; consolidating 7
    sequences on 2 threads (100 x 0.07 = 7 s) would not."""
    p = profile(lambda b: 0.01 * b, lambda b: 0.01 * b)
    choice = choose_tail(tails(a=[100] * 6, b=[10]), [], THREADS, p, ALL, [], move_s)
    assert choice.action == "split"
    assert choice.predicted_s < choice.stay_s == pytest.approx(6.0)
    (shed,) = choice.split.moves
    assert shed.source == "a" and shed.target == "b" and len(shed.positions) >= 2
    assert choice.options["reconfig"]["fire"] is False


def test_stay_when_nothing_finishes_sooner():
    p = profile(lambda b: 0.1 + 0.01 * b, lambda b: 0.1 + 0.01 * b)
    choice = choose_tail(tails(a=[50] * 4, b=[50] * 4), [], THREADS, p, ALL, [], move_s)
    assert choice.action == "stay" and choice.predicted_s == choice.stay_s
    assert choice.options["stay"]["predicted_s"] == pytest.approx(7.0)


def test_the_migration_plan_moves_where_the_engine_cannot_split_or_widen():
    p = profile(lambda b: 0.1 + 0.01 * b, lambda b: 0.05 + 0.005 * b)
    move = Migration("a", "c", ("a0",), 100, 0.5, 2.0, 1.0, 2.0, 1.0, "plan")
    choice = choose_tail(tails(a=[50], b=[10]), ["c"], THREADS | {"c": 1}, p,
                         frozenset({"stay", "recompute"}), [move], move_s)
    assert choice.action == "move" and choice.moves == (move,)
    assert choice.options["split"]["refused"] and choice.options["reconfig"]["refused"]


@pytest.mark.parametrize("force", ["stay", "kv", "recompute", "split", "reconfig"])
def test_a_forced_action_is_taken_where_it_does_not_pay(force):
    """On the profile where staying is best (as above), each forced action is taken."""
    p = profile(lambda b: 0.1 + 0.01 * b, lambda b: 0.1 + 0.01 * b)
    choice = choose_tail(tails(a=[50] * 4, b=[50] * 4), [], THREADS, p, ALL, [], move_s,
                         force=force)
    action = "move" if force in ("kv", "recompute") else force
    assert choice.action == action and choice.reason.startswith("forced")
    if action == "move":
        assert {m.kv for m in choice.moves} == {"transfer" if force == "kv" else "recompute"}
        assert {(m.source, m.target) for m in choice.moves} == {("a", "b"), ("b", "a")}
    if force == "split":
        assert choice.split.moves and choice.split.moves[0].positions == (1, 3)
    if force == "reconfig":
        assert choice.reconfig.threads == 2 and choice.reconfig.target in THREADS


def test_the_profile_follows_the_decode_loops_own_steps():
    """``observe``: measured / profiled at that batch, an EWMA over every point (and every
    repeat): twice as slow at batch 4, alpha 0.5, scales every step by 1.5."""
    p = profile(lambda b: 0.1 + 0.01 * b, lambda b: 0.05 + 0.005 * b)
    p.observe(4, 1, 0.28)
    assert p.scale == pytest.approx(1.5)
    assert float(p.step_seconds(8, 2)) == pytest.approx(1.5 * 0.09)
    assert all(r.scale == p.scale for r in p.repeats())
