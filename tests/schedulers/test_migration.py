"""Cut-and-migrate: hand-checked consolidation and spread, and safety properties."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfless.schedulers.migration import WorkerProgress, plan_migration
from rlhfless.schedulers.throughput import ThroughputModel


def model(slope: float = 1e-4, cap: int | None = None) -> ThroughputModel:
    return ThroughputModel(step_intercept_s=0.02, step_slope_s=slope,
                           prefill_tokens_per_s=20_000, max_batch=cap)


def tail(name: str, n: int, cur: int, rem: int, assigned: int) -> WorkerProgress:
    return WorkerProgress(assigned, assigned - n, [f"{name}/{i}" for i in range(n)],
                          [cur] * n, [rem] * n)


def idle() -> WorkerProgress:
    return WorkerProgress(0, 0, busy=False)


def consolidation_fleet() -> dict[str, WorkerProgress]:
    # A: 9 of 10 done, one sequence of 600 tokens so far with 100 to go; B: 5 of 10 to go
    return {"A": tail("A", 1, 600, 100, 10), "B": tail("B", 5, 500, 1000, 10)}


def test_consolidating_a_tail_into_a_busy_worker_by_hand():
    # stay: A 0.02*100 + 1e-4*100 = 2.01 s, B 0.02*1000 + 1e-4*5000 = 20.5 s
    # move: B prefills 600/20000 = 0.03 s, then 0.02*1000 + 1e-4*5100 = 20.51 s -> 20.54 s
    plan = plan_migration(consolidation_fleet(), 0.7, model(), lambda_cost=0.5)
    assert len(plan) == 1
    m = plan[0]
    assert (m.source, m.target, m.seq_ids, m.recompute_tokens) == ("A", "B", ("A/0",), 600)
    assert m.stay_seconds == pytest.approx(20.5) and m.stay_cost_ws == pytest.approx(22.51)
    assert m.move_seconds == pytest.approx(20.54) and m.move_cost_ws == pytest.approx(20.54)
    assert m.completion_fraction == pytest.approx(0.9)
    json.dumps(m.to_record())


def test_time_only_keeps_the_tail_where_it_is():
    assert plan_migration(consolidation_fleet(), 0.7, model(), lambda_cost=1.0) == []


def test_nothing_moves_below_tau():
    assert plan_migration(consolidation_fleet(), 0.95, model(), lambda_cost=0.5) == []


def spread_fleet() -> dict[str, WorkerProgress]:
    fleet = {"A": tail("A", 20, 1000, 2000, 100)}
    fleet.update({f"I{i}": idle() for i in range(4)})
    return fleet


def test_a_big_tail_spreads_over_idle_workers_when_time_matters():
    # stay: 0.02*2000 + 1e-3*20*2000 = 80 s; over 4 idle workers 5 sequences each:
    # 5*1000/20000 + 0.02*2000 + 1e-3*5*2000 = 50.25 s
    plan = plan_migration(spread_fleet(), 0.7, model(slope=1e-3), lambda_cost=1.0)
    assert sorted(m.target for m in plan) == ["I0", "I1", "I2", "I3"]
    assert all(len(m.seq_ids) == 5 and m.source == "A" for m in plan)
    assert sorted(s for m in plan for s in m.seq_ids) == sorted(f"A/{i}" for i in range(20))
    assert plan[0].stay_seconds == pytest.approx(80.0)
    assert plan[0].move_seconds == pytest.approx(50.25)
    assert plan_migration(spread_fleet(), 0.7, model(slope=1e-3), lambda_cost=0.0) == []


def test_free_slots_bound_where_a_tail_can_go():
    assert plan_migration(spread_fleet(), 0.7, model(1e-3, cap=4), lambda_cost=1.0) == []
    plan = plan_migration(spread_fleet(), 0.7, model(1e-3, cap=5), lambda_cost=1.0)
    assert sorted(len(m.seq_ids) for m in plan) == [5, 5, 5, 5]


def test_bad_progress_is_rejected_with_the_rule():
    with pytest.raises(ValueError, match="every assigned sequence"):
        WorkerProgress(10, 5, ["a"], [1], [1])
    with pytest.raises(ValueError, match="one of each"):
        WorkerProgress(2, 1, ["a"], [1, 2], [1])
    with pytest.raises(ValueError, match="tau"):
        plan_migration({}, 0.0, model())


@st.composite
def fleets(draw):
    n = draw(st.integers(1, 8))
    fleet = {}
    for w in range(n):
        assigned = draw(st.integers(0, 12))
        unfinished = draw(st.integers(0, assigned))
        fleet[f"w{w}"] = WorkerProgress(
            assigned, assigned - unfinished, [f"w{w}/{i}" for i in range(unfinished)],
            draw(st.lists(st.integers(1, 3000), min_size=unfinished, max_size=unfinished)),
            draw(st.lists(st.integers(1, 3000), min_size=unfinished, max_size=unfinished)),
            busy=unfinished > 0,
        )
    return fleet


@settings(max_examples=300, deadline=None)
@given(fleet=fleets(), tau=st.floats(0.05, 1.0), lam=st.floats(0, 1),
       slope=st.sampled_from([1e-5, 1e-4, 1e-3, 1e-2]), cap=st.none() | st.integers(1, 16))
def test_plans_are_safe(fleet, tau, lam, slope, cap):
    plan = plan_migration(fleet, tau, model(slope, cap), lambda_cost=lam)
    sources = {m.source for m in plan}
    targets = {m.target for m in plan}
    assert not sources & targets
    moved = [s for m in plan for s in m.seq_ids]
    assert len(moved) == len(set(moved))  # no sequence moves twice
    for src in sources:
        assert fleet[src].completion_fraction >= tau  # never from a worker under tau
        assert sorted(s for m in plan if m.source == src for s in m.seq_ids) == sorted(
            fleet[src].seq_ids
        )  # the whole tail moves
    for m in plan:
        assert m.target != m.source
        assert m.move_cost_ws >= 0 and m.move_seconds >= 0
    if cap is not None:
        for t in targets:
            received = sum(len(m.seq_ids) for m in plan if m.target == t)
            assert len(fleet[t].seq_ids) + received <= cap


def test_kv_transfer_replaces_recomputation_when_cheaper():
    recompute = plan_migration(consolidation_fleet(), 0.7, model(), lambda_cost=0.5)
    shipped = plan_migration(consolidation_fleet(), 0.7, model(), lambda_cost=0.5,
                             kv_seconds_per_token=1e-6)
    assert recompute[0].kv == "recompute" and shipped[0].kv == "transfer"
    # B receives 600 context tokens: 0.03 s recomputed, 0.0006 s shipped
    assert shipped[0].move_seconds == pytest.approx(recompute[0].move_seconds - 0.03 + 6e-4)
    slow = plan_migration(consolidation_fleet(), 0.7, model(), kv_seconds_per_token=1.0)
    assert slow[0].kv == "recompute"  # a slower link than the prefill is never used
