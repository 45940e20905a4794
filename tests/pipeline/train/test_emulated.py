"""A small emulated run: real worker processes, emulated GPUs (pipeline/train/emulated.py)."""

from __future__ import annotations

import json

import dask
import pytest
from test_kv_elastic import every_paused_tail_moves

from rlhfless.pipeline.cluster.pools import Pool, PoolCluster
from rlhfless.pipeline.config import ConfigError, make_config
from rlhfless.pipeline.task_keys import task_key
from rlhfless.pipeline.train import emulated
from rlhfless.pipeline.train.emulated import (
    QUIET_WORKER_CONFIG,
    EmulatedDeployment,
    _uncovered,
    as_live,
    prior_state,
    run_emulated,
    simulator_policy,
)
from rlhfless.pipeline.train.inputs import check_inputs
from rlhfless.schedulers.ledger import CostLedger
from rlhfless.schedulers.profiles import get_profile
from rlhfless.schedulers.scaling_policy import ScalingPolicy
from rlhfless.schedulers.sim.simulator import ClusterConfig, simulate
from rlhfless.schedulers.sim.workloads import WorkloadConfig, synthetic_trace

SCALE = 0.02
TRACE = synthetic_trace(WorkloadConfig(
    name="small", dataset_prompts=32, batch_prompts=8, n_samples=4, iterations=2,
    response_p50=100.0, response_p99=400.0, max_response_tokens=512, prompt_p50=50.0,
    prompt_p99=100.0))


def _config(policy: str, **extra):
    return make_config({"backend": "emulated", "policy": policy, "gen_workers": 2,
                        "n_samples": 4, "batch_prompts": 8, "max_new_tokens": 512,
                        "emulate_time_scale": SCALE, "worker_memory": "1GiB", **extra})


def test_static_run_takes_the_profiles_time_plus_the_measured_overhead(tmp_path):
    cfg = _config("static")
    out = run_emulated(cfg, TRACE, str(tmp_path), train_gpus=1)
    sim = simulate(TRACE, as_live(get_profile(cfg.emulate_profile)),
                   ClusterConfig(2, 1, colocated=False), simulator_policy(cfg))
    assert len(out["iterations"]) == 2
    for rec, it in zip(out["iterations"], sim.iterations, strict=True):
        assert rec["samples"] == rec["distinct_samples"] == 8 * 4  # each (prompt, sample) once
        ideal = it.gen_s + it.update_s  # the profile's generation (sync included) + update
        assert rec["update_s"] == pytest.approx(it.update_s)
        assert rec["step_s"] >= ideal
        # the critical path, generation then update, each at least its emulated time: the
        # time no emulated task ran (the runtime's overhead) is at most the rest of the step
        path = rec["emulated_path_s"]
        assert rec["step_wall_s"] >= path * SCALE
        assert 0 <= rec["overhead_wall_s"] <= rec["step_wall_s"] - path * SCALE + 1e-9
        # the emulated work is the simulator's, less the weight load in iteration 1: a worker
        # starts holding version 0 (the simulator loads weights in every iteration)
        held = get_profile(cfg.emulate_profile).sync_s if rec["iteration"] == 1 else 0.0
        assert path == pytest.approx(ideal - held)
        assert rec["gen_worker_s"] == pytest.approx(2 * rec["step_s"], rel=0.01)  # both billed
    assert out["memory_peak"]["processes"] >= 3


@pytest.mark.slow
def test_elastic_run_handles_tails_and_logs_decisions(tmp_path, monkeypatch):
    """Every paused tail is moved (the planner's own choices are tested in tests/schedulers;
    on this small trace it keeps them in place): the runtime lands each move by
    recomputation, the emulated engine keeping no KV cache, and loses no sample."""
    cfg = _config("elastic", tau=0.5)
    monkeypatch.setattr(emulated, "prior_state", lambda *a: always_moving(prior_state(*a)))
    out = run_emulated(cfg, TRACE, str(tmp_path), train_gpus=1)
    for rec in out["iterations"]:
        assert rec["samples"] == rec["distinct_samples"] == 8 * 4
        assert 1 <= rec["gen_workers"] <= 2
        assert rec["step_s"] >= rec["update_s"]
    decisions = [json.loads(x) for x in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert [d["iteration"] for d in decisions if d["kind"] == "scale"] == [1, 2]
    moves = [d for d in decisions if d["kind"] == "migrate"]
    assert moves and all(m["reason"].startswith("test: always move") for m in moves), moves
    for move in moves:  # no KV cache: recompute
        assert move["path"] == "recompute" and "keeps no exportable KV cache" in move["reason"]
        assert move["actual_s"] >= 0 and move["landed_sequences"] == move["sequences"]
    assert out["gen_worker_s"] > 0


def always_moving(policy: ScalingPolicy) -> ScalingPolicy:
    """``policy``, except that it plans two workers, keeps an idle one (a target) and moves
    every paused tail to another worker, by KV transfer."""
    plan = policy.plan
    policy.plan = lambda *a, **kw: plan(*a, **kw | {"min_workers": 2})
    policy.keeps_alive = lambda gap: True
    policy.migrate = lambda progress, kv_transfer=False: every_paused_tail_moves(progress)
    return policy


def _diagnostics() -> tuple:
    return tuple(dask.config.get(key) for key in QUIET_WORKER_CONFIG)


POOLS = [Pool("gen", 1, 1, {"GEN": 1}, "1GiB"), Pool("train", 1, 1, {"TRAIN": 1}, "1GiB")]


def test_only_generation_workers_get_the_low_rate_diagnostics():
    gen, train = (EmulatedDeployment().worker_spec(pool, f"{pool.name}-0")["options"]
                  for pool in POOLS)
    assert gen["config"] == QUIET_WORKER_CONFIG and "config" not in train


@pytest.mark.slow
def test_generation_workers_run_dasks_diagnostics_at_a_low_rate():
    with PoolCluster(POOLS, CostLedger(_config("static").prices),
                     deployment=EmulatedDeployment()) as pc:
        seen = pc.client.run(_diagnostics)
        gen, train = seen[pc.address_of("gen-0")], seen[pc.address_of("train-0")]
    assert gen == tuple(QUIET_WORKER_CONFIG.values()) == (False, "1s", "2s")
    assert train == (True, "20ms", "500ms")  # the other pools keep Dask's defaults


def test_train_refuses_the_emulated_backend():
    with pytest.raises(ConfigError, match="emulated"):
        check_inputs(_config("static"))


def _computed(stage: str, *spans: tuple[float, float]) -> dict:
    return {"key": task_key(stage, 1, 0), "startstops": [
        {"action": "compute", "start": a, "stop": b} for a, b in spans]}


def test_uncovered_time_counts_only_the_window():
    """Spans clipped to [t0, t1]; one wholly outside (a worker's times shifted by its clock
    offset) covers nothing, overlaps count once, other stages not at all."""
    stream = [_computed("generate", (1.0, 3.0), (2.0, 4.0)), _computed("update", (11.0, 12.0)),
              _computed("update", (-2.0, -1.0)), _computed("reward", (5.0, 9.0))]
    assert _uncovered(stream, 0.0, 10.0) == pytest.approx(10.0 - 3.0)
