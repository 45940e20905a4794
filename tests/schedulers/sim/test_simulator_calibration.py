"""Calibration on a recorded LocalCluster run (tests/data/recorded_run, made by
bench/record_run.py): fitted on some iterations, the simulator predicts the others."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhfless.schedulers.sim.calibration import calibrate, calibration_table

RUN = Path(__file__).parents[2] / "data" / "recorded_run"


@pytest.fixture(scope="module")
def cal():
    return calibrate(RUN)


def test_split_is_disjoint_and_skips_warm_up(cal):
    assert not set(cal.fit_iterations) & set(cal.eval_iterations)
    assert min(cal.fit_iterations + cal.eval_iterations) == 5
    assert len(cal.eval_iterations) >= 8 and len(cal.rows) == len(cal.eval_iterations)


def test_generation_and_update_time_within_20_percent(cal):
    e = cal.errors()
    print(calibration_table(cal))
    assert abs(e["gen_s_mean"]) < 0.20, e
    assert abs(e["update_s_mean"]) < 0.20, e


def test_total_worker_seconds_within_15_percent(cal):
    assert abs(cal.errors()["worker_s"]) < 0.15, cal.errors()


def test_disjoint_split_is_enforced():
    with pytest.raises(ValueError, match="must be disjoint"):
        calibrate(RUN, fit_iterations=[2, 3], eval_iterations=[3, 4])
