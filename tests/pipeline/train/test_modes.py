"""Async and replay modes on a real LocalCluster with the quick tiny model: the staleness
bound holds per sample, replay shrinks what is generated (and what the elastic policy sizes
its pool for), the buffer goes into the checkpoint; and the pure parts (specs, config)."""

from __future__ import annotations

import os
from collections import Counter

import pyarrow.parquet as pq
import pytest

from rlhfless.ops.algo.update import UpdateParams
from rlhfless.ops.data.schema import SCORED, TRAINABLE
from rlhfless.ops.engine.engine_types import EngineSpec, SamplingParams
from rlhfless.ops.engine.gen_stats import Generated
from rlhfless.pipeline.config import Config, ConfigError
from rlhfless.pipeline.specs import Specs
from rlhfless.pipeline.tasks.rollout import GenSpec
from rlhfless.pipeline.tasks.scoring import RewardSpec, advantage_task
from rlhfless.pipeline.tasks.trainer import TrainSpec
from rlhfless.pipeline.train.loop import train
from rlhfless.pipeline.train.modes import mode_specs

PARITY = {"tally": "parity_reward:parity"}  # informative groups, for replay to replay


def _quick(tiny_model_dir, tmp_path, **kw) -> Config:
    return Config(model=str(tiny_model_dir), runs_dir=str(tmp_path), max_new_tokens=8,
                  heldout_prompts=4, eval_every=100, gen_workers=2, **{"train_threads": 1, **kw})


def _iterations(run) -> list[dict]:
    return [m for m in run.metrics() if m.get("event") == "iteration"]


def test_async_run_keeps_every_sample_within_the_staleness_bound(tiny_model_dir, tmp_path):
    """Also: the pools run the split that fits this machine's cores (overlap_pools =
    "fit_cores", the default), recorded when it is not what was asked."""
    cfg = _quick(tiny_model_dir, tmp_path, mode="async", max_staleness=1, iterations=3,
                 batch_prompts=4, n_samples=2, checkpoint_every=100, train_threads=2)
    lines = []
    run = train(cfg, progress=False, log=lines.append)
    # (generation workers, trainer threads) that fit the cores, by hand from the cost model
    # max(0.5 / g, 0.5 / t) over g + t <= cores: 2 cores leave only (1, 1); on 3, (2, 1)
    # and (1, 2) tie with (1, 1) on time, both use more threads, and (2, 1) has more workers
    cores = len(os.sched_getaffinity(0))
    gen_workers, train_threads = {1: (1, 1), 2: (1, 1), 3: (2, 1)}.get(cores, (2, 2))
    started = {r["name"] for r in run.read_json("ledger.json")["records"]
               if r["kind"] == "worker" and r["pool"] == "gen"}
    assert len(started) == gen_workers
    events = [m for m in run.metrics() if m.get("event") == "pool_split"]
    if (gen_workers, train_threads) == (2, 2):
        assert not events
    else:
        assert [(e["gen_workers"], e["train_threads"], e["asked_gen_workers"])
                for e in events] == [(gen_workers, train_threads, 2)]
        assert any("fit the" in line and "as_set" in line for line in lines)
    records = _iterations(run)
    assert [m["iteration"] for m in records] == [1, 2, 3]
    assert {m["lr"] for m in records} == {cfg.lr * cfg.off_policy_lr_factor}  # and said:
    assert sum("updates at learning rate" in line and "off_policy_lr_factor" in line
               for line in lines) == 1
    for m in records:
        trainer = m["policy_version"]  # the version update i trained from: i - 1
        assert trainer == m["iteration"] - 1
        table = pq.read_table(run.path / "rollouts" / f"iter-{m['iteration']:05d}.parquet")
        pairs = Counter(zip(table.column("prompt_id").to_pylist(),
                            table.column("sample_idx").to_pylist()))
        assert len(pairs) == 8 and set(pairs.values()) == {1}
        for version in table.column("policy_version").to_pylist():  # per sample
            assert 0 <= trainer - version <= cfg.max_staleness
        assert m["staleness_max"] <= cfg.max_staleness
        assert 0 < m["tis_weight_mean"] <= cfg.tis_cap
    # batch 2 was generated with v0 while update 1 ran: the pipeline overlapped
    assert [m["generated_by"] for m in records] == [0, 0, 1]
    assert (run.weights / "v3.safetensors").exists()


# slow: the vLLM async+replay run holds both bounds and the replay run the elastic sizing
@pytest.mark.slow
def test_async_replay_with_the_elastic_policy_keeps_both_bounds(tiny_model_dir, tmp_path):
    """Both modes at once under the elastic policy: batches generated ahead (the driver
    generates batch i+1 while update i runs), part of each from the buffer; fresh rows lag
    at most max_staleness versions, replayed ones at most replay_max_age."""
    cfg = _quick(tiny_model_dir, tmp_path, mode="async+replay", policy="elastic",
                 iterations=4, batch_prompts=6, n_samples=4, max_staleness=1,
                 replay_ratio=0.5, replay_max_age=3, lambda_cost=1.0, checkpoint_every=100,
                 rewards=PARITY)
    run = train(cfg, progress=False, log=lambda *_: None)
    records = _iterations(run)
    assert [m["iteration"] for m in records] == [1, 2, 3, 4]
    assert [m["generated_by"] for m in records] == [0, 0, 1, 2]
    scaled = {d["iteration"]: d["prompts"] for d in run.read_jsonl("decisions.jsonl")
              if d["kind"] == "scale"}
    shares = [d for d in run.read_jsonl("decisions.jsonl") if d["kind"] == "replay_share"]
    assert [d["iteration"] for d in shares] == [1, 2, 3, 4]
    for m in records:
        trainer = m["iteration"] - 1
        assert m["policy_version"] == trainer
        assert m["fresh_prompts"] == cfg.batch_prompts  # fill: replayed groups come on top
        assert m["samples"] == (m["fresh_prompts"] + m["replayed_groups"]) * cfg.n_samples
        assert m["replayed_groups"] <= 3  # round(0.5 * 6)
        assert scaled[m["iteration"]] == m["fresh_prompts"]
        table = pq.read_table(run.path / "rollouts" / f"iter-{m['iteration']:05d}.parquet")
        assert len(table) == m["fresh_prompts"] * cfg.n_samples
        for version in table.column("policy_version").to_pylist():  # fresh rows, per sample
            assert 0 <= trainer - version <= cfg.max_staleness
        assert m["staleness_max"] <= cfg.replay_max_age
    assert sum(m["replayed_groups"] for m in records) > 0


@pytest.mark.slow
def test_replay_with_elastic_policy_generates_only_fresh_prompts(tiny_model_dir, tmp_path):
    cfg = _quick(tiny_model_dir, tmp_path, mode="replay", policy="elastic", iterations=2,
                 batch_prompts=6, n_samples=4, replay_ratio=0.5, replay_max_age=2,
                 lambda_cost=1.0, checkpoint_every=2, rewards=PARITY)
    run = train(cfg, progress=False, log=lambda *_: None)
    records = _iterations(run)
    scaled = {d["iteration"]: d["prompts"] for d in run.read_jsonl("decisions.jsonl")
              if d["kind"] == "scale"}
    for m in records:
        assert m["fresh_prompts"] + m["replayed_groups"] == cfg.batch_prompts
        assert m["replayed_groups"] <= 3  # round(0.5 * 6)
        assert scaled[m["iteration"]] == m["fresh_prompts"]  # the policy saw the smaller need
        assert m["samples"] == cfg.batch_prompts * cfg.n_samples
        table = pq.read_table(run.path / "rollouts" / f"iter-{m['iteration']:05d}.parquet")
        assert len(table) == m["fresh_prompts"] * cfg.n_samples
        assert set(table.column("policy_version").to_pylist()) == {m["iteration"] - 1}
        assert m["staleness_max"] <= cfg.replay_max_age
        assert m["lr"] == cfg.lr * cfg.off_policy_lr_factor  # replayed samples are stale
    assert records[0]["replayed_groups"] == 0  # the buffer starts empty
    assert records[1]["replayed_groups"] > 0
    tables = sorted(p.name for p in run.path.glob("checkpoints/*/tables/*.parquet"))
    assert {"mode_state.parquet", "replay_groups.parquet", "replay_rows.parquet"} <= set(tables)


def _rollouts(run, iteration: int) -> dict:
    table = pq.read_table(run.path / "rollouts" / f"iter-{iteration:05d}.parquet")
    return {k: table.column(k).to_pylist() for k in ("prompt_id", "response_ids",
                                                      "policy_version")}


@pytest.mark.slow
@pytest.mark.parametrize("mode, longest", [("replay", False), ("replay", True),
                                           ("async", False)])
def test_resume_continues_from_the_consumed_data_and_the_buffer(tiny_model_dir, tmp_path,
                                                                mode, longest):
    """Replay resumes bitwise (buffer, its draws, the data position, the replaced prompts'
    skips); async resumes at the data the trainer consumed, redrawing the batches that were
    generated ahead."""
    def cfg(name: str, iterations: int) -> Config:
        return _quick(tiny_model_dir, tmp_path, name=name, mode=mode, iterations=iterations,
                      batch_prompts=4, n_samples=3, checkpoint_every=1, rewards=PARITY,
                      replay_longest=longest)

    whole = train(cfg("whole", 3), progress=False, log=lambda *_: None)
    train(cfg("cut", 2), progress=False, log=lambda *_: None)
    resumed = train(cfg("cut", 3), progress=False, log=lambda *_: None, resume=True)
    want, got = _rollouts(whole, 3), _rollouts(resumed, 3)
    assert sorted(got["prompt_id"]) == sorted(want["prompt_id"])
    last = {m["iteration"]: m for m in _iterations(resumed)}[3]
    if mode == "replay":
        assert got == want
        first = {m["iteration"]: m for m in _iterations(whole)}[3]
        assert last["replayed_groups"] == first["replayed_groups"] > 0
    else:  # generated ahead with v1 in the whole run, again with v2 after the resume
        assert set(want["policy_version"]) == {1} and set(got["policy_version"]) == {2}
        assert last["staleness_max"] == 0
    if longest:  # the predictor has seen none of them: the longest prompts were replaced
        for d in resumed.read_jsonl("decisions.jsonl"):
            if d["kind"] == "replay_share" and d["replaced_prompt_tokens"]:
                assert min(d["replaced_prompt_tokens"]) >= d["fresh_prompt_tokens_max"]


def _specs() -> Specs:
    engine = EngineSpec("m")
    return Specs(GenSpec(engine, 4, SamplingParams()), GenSpec(engine, 1, SamplingParams()),
                 RewardSpec(), TrainSpec(engine, UpdateParams(), "store"))


def test_mode_specs_set_bounds_tis_and_kept_versions():
    specs = _specs()
    assert mode_specs(specs, Config()) == specs  # sync: unchanged
    a = mode_specs(specs, Config(mode="async", max_staleness=3, tis_cap=1.5))
    assert (a.gen.max_staleness, a.train.max_staleness) == (3, 3)
    assert a.train.update.tis_cap == 1.5 and a.train.keep_versions == 5
    r = mode_specs(specs, Config(mode="replay", replay_max_age=4))
    assert (r.gen.max_staleness, r.train.max_staleness, r.train.keep_versions) == (0, 4, 2)
    assert r.train.update.tis_cap == 2.0
    both = mode_specs(specs, Config(mode="async+replay", max_staleness=1, replay_max_age=3))
    assert (both.gen.max_staleness, both.train.max_staleness) == (1, 3)
    assert both.train.keep_versions == 3


def test_the_off_policy_modes_update_at_a_factor_of_lr(tmp_path):
    """The update's learning rate (``make_specs``): ``lr`` in sync, ``lr x
    off_policy_lr_factor`` in the modes that train on stale samples; 1 keeps ``lr``."""
    from rlhfless.pipeline.durable.runs import RunDir
    from rlhfless.pipeline.specs import make_specs

    def update_lr(**kw) -> float:
        return make_specs(Config(lr=4e-4, **kw), tmp_path, RunDir(tmp_path)).train.update.lr

    assert update_lr() == update_lr(off_policy_lr_factor=0.25) == 4e-4
    for mode in ("async", "replay", "async+replay"):
        assert update_lr(mode=mode) == 2e-4
    assert update_lr(mode="replay", off_policy_lr_factor=0.25) == 1e-4
    assert update_lr(mode="async", off_policy_lr_factor=1.0) == 4e-4


def test_agent_episodes_update_at_a_factor_of_lr(tmp_path):
    """Agents' episodes update at ``lr x agent_lr_factor`` (0.5 by default), times
    ``off_policy_lr_factor`` too in the off-policy modes; 1 keeps ``lr``."""
    from rlhfless.pipeline.durable.runs import RunDir
    from rlhfless.pipeline.specs import make_specs

    def update_lr(**kw) -> float:
        cfg = Config(lr=4e-4, task="tally-tool", agent="tally-agent", **kw)
        return make_specs(cfg, tmp_path, RunDir(tmp_path)).train.update.lr

    assert update_lr() == 2e-4
    assert update_lr(mode="async") == 1e-4
    assert update_lr(agent_lr_factor=1.0) == 4e-4
    assert update_lr(mode="async", agent_lr_factor=0.25, off_policy_lr_factor=1.0) == 1e-4


def test_every_mode_runs_at_the_default_replay_age():
    """``replay_max_age = 0`` (the default) is the least age that replays anything: 2 in
    replay, ``2 * max_staleness + 1`` in async+replay (where 2 would replay nothing)."""
    specs = _specs()
    assert mode_specs(specs, Config(mode="replay")).train.max_staleness == 2
    for staleness in (1, 2):
        both = mode_specs(specs, Config(mode="async+replay", max_staleness=staleness))
        assert both.train.max_staleness == 2 * staleness + 1


@pytest.mark.parametrize("values, words", [
    ({"mode": "async", "max_staleness": 0}, ["max_staleness", ">= 1", "'sync'"]),
    ({"mode": "async+replay", "max_staleness": 0}, ["max_staleness", "'async+replay'"]),
    ({"mode": "async+replay", "max_staleness": 1, "replay_max_age": 2},
     ["replay_max_age = 2", ">= 2 * max_staleness + 1 = 3"]),
    ({"mode": "replay", "replay_ratio": 1.0}, ["replay_ratio", "[0, 1)"]),
    ({"tis_cap": 0.9}, ["tis_cap", ">= 1"]),
    ({"replay_size": 0}, ["replay_size", ">= 1"]),
    ({"mode": "async+replay", "replay_max_age": 3, "replay_longest": True},
     ["replay_longest", "mode = 'replay'"]),
    ({"mode": "replay", "replay_max_skips": 0}, ["replay_max_skips", ">= 1"]),
    ({"off_policy_lr_factor": 0}, ["off_policy_lr_factor = 0", "(0, 1]"]),
    ({"off_policy_lr_factor": 1.5}, ["off_policy_lr_factor = 1.5", "(0, 1]"]),
    ({"agent_lr_factor": 0}, ["agent_lr_factor = 0", "(0, 1]"]),
    ({"agent_lr_factor": 2}, ["agent_lr_factor = 2", "(0, 1]"]),
    ({"mode": "streaming"}, ["mode", "'sync', 'async', 'replay', 'async+replay'"]),
])
def test_mode_knobs_are_checked(values, words):
    with pytest.raises(ConfigError) as err:
        Config(**values)
    for word in words:
        assert word in str(err.value)


def test_an_empty_shard_concatenates_with_full_ones():
    """Replay shrinks the fresh batch, so a shard can be empty; its trainable table must
    have the schema of a full one, or the update cannot concatenate them."""
    empty = Generated(SCORED.empty_table())
    assert advantage_task(empty, "grpo", 2).table.schema.field("advantage") == TRAINABLE.field(
        "advantage")
