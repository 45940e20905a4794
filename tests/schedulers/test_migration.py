"""Cut-and-migrate: hand-checked consolidation and spread, and safety properties."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfless.schedulers.migration import WorkerProgress, plan_migration, tail_batch
from rlhfless.schedulers.throughput import ThroughputModel


def model(slope: float = 1e-4, cap: int | None = None) -> ThroughputModel:
    return ThroughputModel(step_intercept_s=0.02, step_slope_s=slope,
                           prefill_tokens_per_s=20_000, max_batch=cap)


def tail(name: str, n: int, cur: int, rem: int, assigned: int,
         paused: bool = True) -> WorkerProgress:
    """A worker with ``n`` unfinished sequences; paused (cuttable) unless it runs a chunk."""
    return WorkerProgress(assigned, assigned - n, [f"{name}/{i}" for i in range(n)],
                          [cur] * n, [rem] * n, busy=not paused)


def idle() -> WorkerProgress:
    return WorkerProgress(0, 0, busy=False)


def consolidation_fleet() -> dict[str, WorkerProgress]:
    # A: a paused tail of one sequence (600 tokens so far, 100 to go); B runs 5 long ones;
    # C runs 300 longer ones and ends last
    return {"A": tail("A", 1, 600, 100, 10), "B": tail("B", 5, 500, 1000, 10, paused=False),
            "C": tail("C", 300, 300, 1200, 400, paused=False)}


def test_consolidating_a_tail_where_there_is_slack_by_hand():
    # tail batch 0.02 / (2 * 1e-4) = 100: A (1 sequence) is a tail, C (300) is not
    # stay: A 0.02*100 + 1e-4*100 = 2.01 s, B 0.02*1000 + 1e-4*5000 = 20.5 s,
    #       C 0.02*1200 + 1e-4*360000 = 60 s: the step ends at 60 s, 82.51 worker-s
    # A -> B: B prefills 600/20000 = 0.03 s, then 0.02*1000 + 1e-4*5100 -> 20.54 s, ends at 60
    # A -> C: 0.03 + 0.02*1200 + 1e-4*360100 = 60.04 s: later than staying, never taken
    plan = plan_migration(consolidation_fleet(), None, model(), lambda_cost=0.5)
    assert len(plan) == 1
    m = plan[0]
    assert (m.source, m.target, m.seq_ids, m.recompute_tokens) == ("A", "B", ("A/0",), 600)
    assert m.stay_seconds == pytest.approx(60.0) and m.stay_cost_ws == pytest.approx(82.51)
    assert m.move_seconds == pytest.approx(60.0) and m.move_cost_ws == pytest.approx(80.54)
    assert m.completion_fraction == pytest.approx(0.9)
    json.dumps(m.to_record())


def test_a_move_that_would_end_the_step_later_is_never_taken():
    fleet = consolidation_fleet()
    del fleet["C"]  # B is now the last to finish: A -> B ends at 20.54 s > 20.5 s
    assert plan_migration(fleet, None, model(), lambda_cost=0.0) == []


def test_time_only_keeps_the_tail_where_it_is():
    assert plan_migration(consolidation_fleet(), None, model(), lambda_cost=1.0) == []


def test_the_tail_triggers_not_the_completion_count():
    fleet = consolidation_fleet()
    # 250 sequences left of 5000 (completion 0.95): more than the tail batch of 100
    big = dict(fleet, A=tail("A", 250, 600, 100, 5000))
    assert plan_migration(big, None, model(), lambda_cost=0.5) == []
    # one sequence left of 2 (completion 0.5): a tail, whatever the count says
    early = dict(fleet, A=tail("A", 1, 600, 100, 2))
    assert [m.source for m in plan_migration(early, None, model(), lambda_cost=0.5)] == ["A"]
    # a worker running a chunk cannot be cut; an explicit tau still gates by completion
    running = dict(fleet, A=tail("A", 1, 600, 100, 10, paused=False))
    assert plan_migration(running, None, model(), lambda_cost=0.5) == []
    assert plan_migration(fleet, 0.95, model(), lambda_cost=0.5) == []
    assert tail_batch(model()) == pytest.approx(100.0)
    assert tail_batch(model(cap=16)) == 16


def spread_fleet() -> dict[str, WorkerProgress]:
    fleet = {"A": tail("A", 8, 1000, 2000, 100)}
    fleet.update({f"I{i}": idle() for i in range(4)})
    return fleet


def test_a_big_tail_spreads_over_idle_workers_when_time_matters():
    # tail batch 0.02 / (2 * 1e-3) = 10: A's 8 sequences are its tail
    # stay: 0.02*2000 + 1e-3*8*2000 = 56 s; over 4 idle workers 2 sequences each:
    # 2*1000/20000 + 0.02*2000 + 1e-3*2*2000 = 44.1 s (sooner, but 176.4 worker-s)
    plan = plan_migration(spread_fleet(), None, model(slope=1e-3), lambda_cost=1.0)
    assert sorted(m.target for m in plan) == ["I0", "I1", "I2", "I3"]
    assert all(len(m.seq_ids) == 2 and m.source == "A" for m in plan)
    assert sorted(s for m in plan for s in m.seq_ids) == sorted(f"A/{i}" for i in range(8))
    assert plan[0].stay_seconds == pytest.approx(56.0)
    assert plan[0].move_seconds == pytest.approx(44.1)
    assert plan_migration(spread_fleet(), None, model(slope=1e-3), lambda_cost=0.0) == []


def test_tails_are_planned_jointly_within_the_targets_time_and_slots():
    # tail batch 0.02 / (2 * 0.01) = 1: S1, S2, S3 (one sequence each) are tails. T (busy)
    # can take one of them and still end before L (at most 10.2 s < 10.8 s); two would end
    # it after L (11.1 s or more)
    fleet = {"S1": tail("S1", 1, 0, 100, 4), "S2": tail("S2", 1, 0, 110, 4),
             "S3": tail("S3", 1, 0, 120, 4), "T": tail("T", 1, 0, 300, 4, paused=False),
             "L": tail("L", 1, 0, 360, 4, paused=False)}
    m = model(slope=0.01)
    plan = plan_migration(fleet, None, m, lambda_cost=0.0)
    received = {t: sum(len(x.seq_ids) for x in plan if x.target == t) for t in fleet}
    assert received["T"] <= 1 and received["L"] == 0  # no pile-on, the last one untouched
    assert len({x.source for x in plan}) == 2  # two tails released: each merged elsewhere
    assert predicted_end(fleet, plan, m)[0] <= predicted_end(fleet, [], m)[0] + 1e-9


def predicted_end(fleet: dict[str, WorkerProgress], plan: list, m: ThroughputModel,
                  ) -> tuple[float, float]:
    """(last finish, summed finishes) of ``fleet`` after ``plan``, recomputed from scratch:
    each worker's longest and total remaining tokens plus the context it receives."""
    rem = {w: list(p.remaining_tokens) for w, p in fleet.items()}
    pre = dict.fromkeys(fleet, 0.0)
    for mv in plan:
        src = fleet[mv.source]
        for s in mv.seq_ids:
            i = src.seq_ids.index(s)
            rem[mv.target].append(src.remaining_tokens[i])
            pre[mv.target] += src.current_lengths[i]
            rem[mv.source].remove(src.remaining_tokens[i])
    ends = [pre[w] / m.prefill_tokens_per_s + float(m.decode_seconds(max(r), sum(r)))
            if r else 0.0 for w, r in rem.items()]
    return max(ends, default=0.0), sum(ends)


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
            busy=unfinished > 0 and draw(st.booleans()),
        )
    return fleet


@settings(max_examples=300, deadline=None)
@given(fleet=fleets(), tau=st.none() | st.floats(0.05, 1.0), lam=st.floats(0, 1),
       slope=st.sampled_from([1e-5, 1e-4, 1e-3, 1e-2]), cap=st.none() | st.integers(1, 16))
def test_plans_are_safe(fleet, tau, lam, slope, cap):
    m = model(slope, cap)
    plan = plan_migration(fleet, tau, m, lambda_cost=lam)
    sources = {mv.source for mv in plan}
    targets = {mv.target for mv in plan}
    assert not sources & targets
    moved = [s for mv in plan for s in mv.seq_ids]
    assert len(moved) == len(set(moved))  # no sequence moves twice
    for src in sources:  # only a paused tail moves, and all of it
        p = fleet[src]
        assert not p.busy and len(p.seq_ids) <= tail_batch(m)
        assert tau is None or p.completion_fraction >= tau
        assert sorted(s for mv in plan if mv.source == src for s in mv.seq_ids) == sorted(
            p.seq_ids)
    for mv in plan:
        assert mv.target != mv.source
        assert mv.move_cost_ws >= 0 and mv.move_seconds <= mv.stay_seconds
    if cap is not None:  # no target receives more than its free slots
        for t in targets:
            received = sum(len(mv.seq_ids) for mv in plan if mv.target == t)
            assert len(fleet[t].seq_ids) + received <= cap
    # the whole plan, recomputed from scratch: never ends later; at lambda 0 never costs more
    (end, cost), (stay_end, stay_cost) = predicted_end(fleet, plan, m), predicted_end(
        fleet, [], m)
    assert end <= stay_end * (1 + 1e-9) + 1e-9
    if lam == 0:
        assert cost <= stay_cost * (1 + 1e-9) + 1e-9


def test_kv_transfer_replaces_recomputation_when_cheaper():
    recompute = plan_migration(consolidation_fleet(), None, model(), lambda_cost=0.5)
    shipped = plan_migration(consolidation_fleet(), None, model(), lambda_cost=0.5,
                             kv_seconds_per_token=1e-6)
    assert recompute[0].kv == "recompute" and shipped[0].kv == "transfer"
    # B receives 600 context tokens: 0.03 s recomputed, 0.0006 s shipped
    assert shipped[0].move_cost_ws == pytest.approx(recompute[0].move_cost_ws - 0.03 + 6e-4)
    slow = plan_migration(consolidation_fleet(), None, model(), kv_seconds_per_token=1.0)
    assert slow[0].kv == "recompute"  # a slower link than the prefill is never used
