"""The modes in the simulator: the async recurrence by hand, the staleness bound, the fill
bound, and every mode against sync on a small long-CoT trace."""

from __future__ import annotations

import dataclasses

import pytest

from rlhfless.schedulers.profiles import get_profile
from rlhfless.schedulers.sim.modes import ModeKnobs, fill_bound, pipelined, simulate_modes
from rlhfless.schedulers.sim.sim_policy import ELASTIC
from rlhfless.schedulers.sim.simulator import ClusterConfig
from rlhfless.schedulers.sim.workloads import LONG_COT, synthetic_trace


def test_async_recurrence_by_hand():
    # k = 1: batch 2 waits for nothing, batch 3 for update 1 (done at 2 + 1 = 3)
    out = pipelined([2.0, 2.0, 2.0], [1.0, 1.0, 1.0], batch=4, n_samples=2,
                    knobs=ModeKnobs(max_staleness=1), replay=False)
    # gen 0-2, 2-4, 4-6; updates 2-3, 4-5, 6-7
    assert out["total_s"] == 7.0 and out["samples"] == 24 and out["staleness_max"] == 1
    sync_like = pipelined([2.0] * 3, [1.0] * 3, 4, 2, ModeKnobs(max_staleness=0), False)
    assert sync_like["total_s"] == 9.0 and sync_like["staleness_max"] == 0


def test_fill_replays_into_idle_trainer_time_only():
    knobs = ModeKnobs(max_staleness=1, replay_ratio=0.5, replay_max_age=3)
    gen_bound = pipelined([2.0] * 6, [1.0] * 6, 4, 1, knobs, replay=True)
    assert gen_bound["replayed_frac"] > 0 and gen_bound["staleness_max"] <= 1
    assert gen_bound["samples_per_s"] <= fill_bound(2.0, 1.0, 0.5) * 4 / 2
    update_bound = pipelined([1.0] * 6, [2.0] * 6, 4, 1, knobs, replay=True)
    assert update_bound["replayed_frac"] == 0
    assert fill_bound(2.0, 1.0, 0.5) == 1.5 and fill_bound(1.0, 2.0, 0.5) == 1.0


def test_every_mode_against_sync_on_long_cot():
    trace = synthetic_trace(dataclasses.replace(LONG_COT, iterations=4, batch_prompts=32))
    rows = simulate_modes(trace, get_profile("Qwen3-14B@H100"), ClusterConfig(16), ELASTIC)
    by = {r["mode"]: r for r in rows}
    assert list(by) == ["sync", "replay", "async", "async+replay"]
    assert by["sync"]["vs_sync"] == 1.0
    assert by["replay"]["replayed_frac"] > 0
    assert by["async"]["staleness_max"] <= 1
    assert by["async"]["gen_gpus"] + by["async"]["train_gpus"] == 16
    assert by["async+replay"]["samples_per_s"] >= by["async"]["samples_per_s"]
    assert by["async+replay"]["paper"] == "ReFlow 2.06x"


def test_a_cluster_too_small_to_split_is_named():
    trace = synthetic_trace(dataclasses.replace(LONG_COT, iterations=1, batch_prompts=8))
    with pytest.raises(ValueError, match="cannot be split"):
        simulate_modes(trace, get_profile("Qwen3-14B@H100"), ClusterConfig(1), ELASTIC)
