"""CostLedger: worker-seconds and cost against hand sums, attribution to iterations, records."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfless.schedulers.ledger import CostLedger


def run() -> CostLedger:
    led = CostLedger({"gen": 2.0, "train": 1.0})
    led.worker_started("g1", "gen", 0.0, cold_start_s=5.0)  # billed from -5
    led.worker_ready("g1", 10.0)
    led.worker_started("t1", "train", 0.0)
    led.worker_started("g2", "gen", 20.0)
    led.worker_stopped("g2", 50.0)
    led.worker_stopped("g1", 100.0)
    led.mark("generate", 0, 0.0, 40.0)
    led.mark("update", 0, 40.0, 60.0)
    led.mark("generate", 1, 60.0, 120.0)
    return led


def test_worker_seconds_and_cost_by_hand():
    led = run()
    assert led.worker_seconds("gen") == pytest.approx(105 + 30)
    with pytest.raises(ValueError, match=r"\['t1'\] are still running"):
        led.worker_seconds("train")
    assert led.worker_seconds("train", until=200.0) == pytest.approx(200)
    assert led.worker_seconds(until=200.0) == pytest.approx(335)
    assert led.worker_seconds("gen", until=30.0) == pytest.approx(35 + 10)  # clipped at until
    assert led.cost(until=200.0) == pytest.approx(2 * 135 + 200)
    assert led.cold_starts("gen") == [15.0]
    assert led.running() == ["t1"]


def test_attribution_to_iterations_and_stages_by_hand():
    led = run()
    it0, it1 = led.by_iteration(until=200.0)
    # iteration 0 spans 0..60: g1 60 s, g2 30 s, t1 60 s
    assert (it0["iteration"], it0["wall_s"]) == (0, 60.0)
    assert it0["gen_worker_s"] == pytest.approx(90) and it0["train_worker_s"] == pytest.approx(60)
    assert it0["cost"] == pytest.approx(2 * 90 + 60)
    # iteration 1 spans 60..120: g1 40 s, t1 60 s
    assert it1["gen_worker_s"] == pytest.approx(40) and it1["cost"] == pytest.approx(140)
    stages = led.by_stage(until=200.0)
    assert [(s["iteration"], s["stage"]) for s in stages] == [
        (0, "generate"), (0, "update"), (1, "generate")]
    assert stages[1]["worker_s"] == pytest.approx(20 + 10 + 20)
    totals = led.totals(until=200.0)
    # outside 0..120: g1's 5 s before 0, t1's 80 s after 120
    assert totals["unattributed_worker_s"] == pytest.approx(85)
    assert totals["worker_s"] == pytest.approx(335) and totals["cost"] == pytest.approx(470)


def test_records_have_one_schema_and_load_into_arrow():
    rows = run().records(until=200.0)
    assert len({tuple(r) for r in rows}) == 1
    table = pa.Table.from_pylist(rows)
    assert table.num_rows == 6
    json.dumps(rows)
    t1 = next(r for r in rows if r["name"] == "t1")
    assert t1["t_end"] is None and t1["worker_s"] == 200.0 and t1["cost"] == 200.0


def test_a_name_may_start_again_after_it_stopped():
    led = CostLedger({"gen": 1.0})
    led.worker_started("w", "gen", 0.0)
    led.worker_stopped("w", 10.0)
    led.worker_started("w", "gen", 20.0)
    led.worker_stopped("w", 25.0)
    assert led.worker_seconds() == pytest.approx(15.0)


def test_bad_events_say_what_is_wrong():
    led = CostLedger({"gen": 1.0})
    with pytest.raises(ValueError, match="known pools: \\['gen'\\]"):
        led.worker_started("w", "gpu", 0.0)
    led.worker_started("w", "gen", 5.0)
    with pytest.raises(ValueError, match="already running"):
        led.worker_started("w", "gen", 6.0)
    with pytest.raises(ValueError, match="before its start"):
        led.worker_stopped("w", 1.0)
    with pytest.raises(ValueError, match="not running"):
        led.worker_ready("x", 6.0)
    with pytest.raises(ValueError, match="t_end"):
        led.mark("generate", 0, 5.0, 1.0)
    with pytest.raises(ValueError, match="at least one pool"):
        CostLedger({})


@settings(max_examples=100, deadline=None)
@given(
    lives=st.lists(st.tuples(st.floats(0, 100), st.floats(0, 100), st.sampled_from(["a", "b"])),
                   max_size=12),
    cuts=st.lists(st.floats(0, 100), min_size=1, max_size=6, unique=True),
)
def test_disjoint_iterations_plus_unattributed_add_up_to_the_total(lives, cuts):
    led = CostLedger({"a": 1.5, "b": 1.0})
    for i, (t0, dt, pool) in enumerate(lives):
        led.worker_started(f"w{i}", pool, t0)
        led.worker_stopped(f"w{i}", t0 + dt)
    cuts = sorted(cuts)
    for it, (t0, t1) in enumerate(zip(cuts[:-1], cuts[1:], strict=True)):
        led.mark("generate", it, t0, t1)
    totals = led.totals()
    attributed = sum(r["worker_s"] for r in led.by_iteration())
    assert attributed + totals["unattributed_worker_s"] == pytest.approx(totals["worker_s"])
    assert totals["worker_s"] == pytest.approx(sum(dt for _, dt, _ in lives))
