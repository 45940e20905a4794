"""Emulated runs through ``train(cfg)``: real worker processes and driver, emulated GPUs
(``pipeline/train/emulation.py``, ``pipeline/tasks/emulated.py``), held against the
simulator on the same trace."""

from __future__ import annotations

import dataclasses
import json

import dask
import pyarrow.parquet as pq
import pytest
from test_kv_elastic import every_paused_tail_moves

from rlhfless.pipeline.cluster.pools import Pool, PoolCluster
from rlhfless.pipeline.config import make_config
from rlhfless.pipeline.report.trace_events import read_trace
from rlhfless.pipeline.tasks.emulated import EmulatedEngine
from rlhfless.pipeline.train.emulation import (
    QUIET_WORKER_CONFIG,
    EmulatedDeployment,
    Emulation,
    as_live,
    simulator_policy,
)
from rlhfless.pipeline.train.loop import train
from rlhfless.schedulers.ledger import CostLedger
from rlhfless.schedulers.profiles import get_profile
from rlhfless.schedulers.scaling_policy import ScalingPolicy
from rlhfless.schedulers.sim.simulator import ClusterConfig, simulate
from rlhfless.schedulers.sim.workloads import GSM8K, synthetic_trace

SCALE = 0.02
BATCH, N, ITERATIONS, MAX_NEW = 8, 4, 2, 512


def _config(tmp_path, policy: str, **extra):
    return make_config({"backend": "emulated", "policy": policy, "gen_workers": 2,
                        "n_samples": N, "batch_prompts": BATCH, "max_new_tokens": MAX_NEW,
                        "iterations": ITERATIONS, "emulate_time_scale": SCALE,
                        "emulate_train_gpus": 1, "heldout_prompts": 4,
                        "on_collapse": "warn", "worker_memory": "1GiB",
                        "runs_dir": str(tmp_path), **extra})


def _trace():
    """The run's trace, drawn here from the workload's own parameters: iteration i of the
    run must get batch i of it."""
    return synthetic_trace(dataclasses.replace(
        GSM8K, iterations=ITERATIONS + 1, batch_prompts=BATCH, n_samples=N,
        max_response_tokens=MAX_NEW, seed=0)).head(ITERATIONS)


def _records(run) -> list[dict]:
    return [r for r in run.metrics() if r.get("event") == "iteration"]


def _each_sample_once(run, trace) -> None:
    for batch in trace.batches:
        rows = pq.read_table(run.path / "rollouts" / f"iter-{batch.iteration:05d}.parquet")
        pairs = list(zip(rows.column("prompt_id").to_pylist(),
                         rows.column("sample_idx").to_pylist()))
        assert len(pairs) == len(set(pairs)) == BATCH * N
        assert {p for p, _ in pairs} == set(batch.prompt_ids.tolist())
        lengths = sorted(len(r) for r in rows.column("response_ids").to_pylist())
        assert lengths == sorted(batch.lengths.reshape(-1).tolist())  # the trace's lengths


def test_a_static_run_takes_the_profiles_time_through_the_one_driver(tmp_path):
    cfg = _config(tmp_path, "static")
    run = train(cfg, progress=False, log=lambda _: None)
    trace = _trace()
    _each_sample_once(run, trace)
    sim = simulate(trace, as_live(get_profile(cfg.emulate_profile)),
                   ClusterConfig(2, 1, colocated=False), simulator_policy(cfg))
    records = _records(run)
    assert [r["iteration"] for r in records] == [1, 2]
    for rec, it in zip(records, sim.iterations, strict=True):
        assert rec["update_seconds"] == pytest.approx(it.update_s)
        # the step holds the profile's generation then update; the first iteration's
        # workers hold version 0 already (the simulator loads weights in every iteration)
        held = get_profile(cfg.emulate_profile).sync_s if rec["iteration"] == 1 else 0.0
        assert rec["iteration_s"] / SCALE >= it.gen_s + it.update_s - held
        # both workers billed through the iteration, in emulated seconds
        assert rec["gen_worker_s"] == pytest.approx(2 * rec["train_worker_s"], rel=0.01)
    assert (run.path / "checkpoints").is_dir()
    # the run's trace, as any run's: each generate task a span on a generation worker
    events = read_trace(run.path / "trace.json")
    tracks = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    generated = [tracks[e["pid"]] for e in events if e["ph"] == "X" and e["name"] == "generate"]
    assert len(generated) >= ITERATIONS and all(t.startswith("gen-") for t in generated)
    # the emulated engine's decode spans: each iteration's add up to its decode tokens
    spans = [e["args"] for e in events
             if e["ph"] == "X" and e["cat"] == "phase" and e["name"] == "decode"]
    for rec in records:
        assert sum(a["tokens"] for a in spans if a["iteration"] == rec["iteration"]
                   and not a["tag"]) == rec["decode_tokens"] > 0


def always_moving(policy: ScalingPolicy) -> ScalingPolicy:
    """``policy``, except that it plans two workers, keeps an idle one (a target) and moves
    every paused tail to another worker."""
    plan = policy.plan
    policy.plan = lambda *a, **kw: plan(*a, **kw | {"min_workers": 2})
    policy.keeps_alive = lambda gap: True
    policy.migrate = lambda progress, kv_transfer=False: every_paused_tail_moves(progress)
    return policy


def moving_one_by_one(monkeypatch) -> None:
    """The engine offers no split or reconfiguration (as vLLM's): each paused tail is
    decided on its own, not the pool's together."""
    monkeypatch.setattr(EmulatedEngine, "tail_actions", frozenset({"stay", "kv", "recompute"}))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_elastic_run_moves_its_tails_one_by_one_and_loses_nothing(tmp_path, monkeypatch,
                                                                     mode):
    """Every paused tail is moved (the planner's own choices are tested in tests/schedulers):
    the runtime lands each move, its KV exported or its context recomputed, as the cost
    model says."""
    moving_one_by_one(monkeypatch)
    scaling = Emulation.scaling
    monkeypatch.setattr(Emulation, "scaling", lambda self: always_moving(scaling(self)))
    run = train(_config(tmp_path, "elastic", tau=0.5, mode=mode), progress=False,
                log=lambda _: None)
    _each_sample_once(run, _trace())
    for rec in _records(run):
        assert 1 <= rec["gen_workers"] <= 2
    decisions = [json.loads(x) for x in (run.path / "decisions.jsonl").read_text().splitlines()]
    assert [d["iteration"] for d in decisions if d["kind"] == "scale"] == [1, 2]
    (declared,) = [d for d in decisions if d["kind"] == "tail_actions"]  # what it cannot do
    assert declared["supported"] == ["kv", "recompute", "stay"]
    assert set(declared["refused"]) == {"split", "reconfig"}
    assert not [d for d in decisions if d["kind"] in ("step_profile", "tail")]
    moves = [d for d in decisions if d["kind"] == "migrate"]
    assert moves and all(m["reason"].startswith("test: always move") for m in moves), moves
    for move in moves:
        assert move["path"] in ("transfer", "recompute")
        assert move["actual_s"] >= 0 and move["landed_sequences"] == move["sequences"]
    # the trace shows each move on both workers: the chunk cut on one, its rest on the other
    events = read_trace(run.path / "trace.json")
    tracks = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    ran = {(e["name"], e["args"].get("iteration"), tracks[e["pid"]]) for e in events
           if e["ph"] == "X" and e["cat"] == "task"}
    for move in moves:
        assert move["source"] != move["target"]
        assert {("generate", move["iteration"], move["source"]),
                ("continue", move["iteration"], move["target"])} <= ran, move


@pytest.mark.slow
def test_a_forced_reconfiguration_widens_the_target_and_holds_its_sources(tmp_path):
    """``tail_action = "reconfig"`` on two emulated workers: at the pool's pause every
    tail is consolidated onto one worker widened to TP 2 (PAT), the other's tail landed by
    KV or recomputed; the source is held, not released, while the target decodes; every
    (prompt, sample) once, each iteration."""
    run = train(_config(tmp_path, "elastic", tau=0.5, tail_action="reconfig",
                        gen_min_workers=2), progress=False, log=lambda _: None)
    _each_sample_once(run, _trace())
    decisions = [json.loads(x) for x in (run.path / "decisions.jsonl").read_text().splitlines()]
    (declared,) = [d for d in decisions if d["kind"] == "tail_actions"]
    assert declared["supported"] == ["kv", "recompute", "reconfig", "split", "stay"]
    (profile,) = [d for d in decisions if d["kind"] == "step_profile"]
    assert {"1x1", "1x2"} <= set(profile["median_s"])  # TP 1 and TP 2, by batch
    tails = [d for d in decisions if d["kind"] == "tail"]
    landed = [d for d in decisions if d["kind"] == "tail_move"]
    assert [d["iteration"] for d in tails] == [d["iteration"] for d in landed] == [1, 2]
    events = read_trace(run.path / "trace.json")
    tracks = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    ran = {(e["name"], e["args"].get("iteration"), tracks[e["pid"]]) for e in events
           if e["ph"] == "X" and e["cat"] == "task"}
    for tail, move in zip(tails, landed):
        assert tail["action"] == "reconfig" and tail["reason"].startswith("forced: ")
        assert tail["actual_s"] > 0 and tail["sequences_moved"] > 0
        (source,) = move["moves"]
        assert move["action"] == "reconfig" and source != move["target"]
        assert move["moves"][source]["path"] in ("transfer", "recompute")
        assert ("resume", tail["iteration"], move["target"]) in ran
        # held by the wider TP while it decodes: released, if at all, after generation
        assert not [d for d in decisions if d["kind"] == "release"
                    and "consolidated" in d.get("reason", "")]


def moving_to(policy: ScalingPolicy, target: str) -> ScalingPolicy:
    """``always_moving``, every tail sent to ``target``."""
    policy = always_moving(policy)
    policy.migrate = lambda progress, kv_transfer=False: [
        dataclasses.replace(m, target=target) for m in every_paused_tail_moves(progress)]
    return policy


@pytest.mark.slow
def test_a_move_to_a_worker_that_has_gone_lands_on_another(tmp_path, monkeypatch):
    """The policy sends each tail to a worker that is not in the pool (one released or lost
    between the decision and the move): the controller replaces it by a worker of the pool,
    says so, and loses no sample (before: KeyError, the run ended)."""
    moving_one_by_one(monkeypatch)
    scaling = Emulation.scaling
    monkeypatch.setattr(Emulation, "scaling",
                        lambda self: moving_to(scaling(self), "gen-gone"))
    run = train(_config(tmp_path, "elastic", tau=0.5), progress=False, log=lambda _: None)
    _each_sample_once(run, _trace())
    decisions = [json.loads(x) for x in (run.path / "decisions.jsonl").read_text().splitlines()]
    moves = [d for d in decisions if d["kind"] == "migrate"]
    replaced = [d for d in decisions if d["kind"] == "replace"]
    assert moves and all(m["target"] == "gen-gone" for m in moves)
    assert len(replaced) == len(moves)
    assert all(r["worker"] == "gen-gone" and r["by"].startswith("gen-") for r in replaced)


def _diagnostics() -> tuple:
    return tuple(dask.config.get(key) for key in QUIET_WORKER_CONFIG)


POOLS = [Pool("gen", 1, 1, {"GEN": 1}, "1GiB"), Pool("train", 1, 1, {"TRAIN": 1}, "1GiB")]


def test_only_generation_workers_get_the_low_rate_diagnostics():
    gen, train_ = (EmulatedDeployment().worker_spec(pool, f"{pool.name}-0")["options"]
                   for pool in POOLS)
    assert gen["config"] == QUIET_WORKER_CONFIG and "config" not in train_


@pytest.mark.slow
def test_generation_workers_run_dasks_diagnostics_at_a_low_rate(tmp_path):
    with PoolCluster(POOLS, CostLedger(_config(tmp_path, "static").prices),
                     deployment=EmulatedDeployment()) as pc:
        seen = pc.client.run(_diagnostics)
        gen, train_ = seen[pc.address_of("gen-0")], seen[pc.address_of("train-0")]
    assert gen == tuple(QUIET_WORKER_CONFIG.values()) == (False, "1s", "2s")
    assert train_ == (True, "20ms", "500ms")  # the other pools keep Dask's defaults
