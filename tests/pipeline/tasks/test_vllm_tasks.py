"""The vllm backend inside the pipeline, on a real vLLM engine (CPU build here and in CI):
a generation task on a daemonic Dask worker process, and a whole short run that leaves no
process behind. Skips without vLLM; fails instead under ``RLHFLESS_REQUIRE_VLLM=1``."""

from __future__ import annotations

import json

import psutil
import pytest
from distributed import Client, LocalCluster
from transformers import AutoTokenizer
from vllm_support import require_vllm, vllm_processes

from rlhfless.ops.data.load import read_prompts
from rlhfless.ops.engine.engine_types import EngineSpec, SamplingParams, WeightsRef
from rlhfless.pipeline.tasks.rollout import GenSpec

require_vllm()

TASK_TIMEOUT_S = 180  # a task on a paused worker never starts: fail instead of waiting


def test_a_vllm_run_in_async_replay_keeps_both_bounds_and_leaves_no_process(tiny_model_dir,
                                                                             tmp_path):
    """A whole run on two vLLM workers in both modes at once: batch i+1 generated while
    update i runs, part of each from the replay buffer; fresh rows lag at most
    max_staleness versions; every iteration evaluated; no process outlives the run."""
    from rlhfless.pipeline.config import Config
    from rlhfless.pipeline.train.loop import train

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    cfg = Config(model=str(tiny_model_dir), runs_dir=str(tmp_path), name="vllm-modes",
                 backend="vllm", mode="async+replay", iterations=3, batch_prompts=6,
                 n_samples=4, max_new_tokens=8, max_staleness=1, replay_ratio=0.5,
                 replay_max_age=3, heldout_prompts=4, eval_every=1, checkpoint_every=100,
                 gen_workers=2, train_threads=1, rewards={"tally": "parity_reward:parity"})
    run = train(cfg, progress=False, log=lambda *_: None)
    records = [m for m in run.metrics() if m.get("event") == "iteration"]
    assert [m["generated_by"] for m in records] == [0, 0, 1]
    for m in records:
        assert m["policy_version"] == m["iteration"] - 1
        assert m["staleness_max"] <= cfg.replay_max_age
    assert sum(m["replayed_groups"] for m in records) > 0
    evals = [m["iteration"] for m in run.metrics() if m.get("event") == "eval"]
    assert evals == [0, 1, 2, 3]
    assert vllm_processes() == []
    left = [p for p in psutil.Process().children(recursive=True)
            if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline())]
    assert left == []


def _pairs(table) -> list[tuple[str, int]]:
    return list(zip(table.column("prompt_id").to_pylist(), table.column("sample_idx").to_pylist()))


def _memory_state(dask_worker) -> tuple[str, float]:
    memory = dask_worker.memory_manager
    rss = psutil.Process().memory_info().rss
    return dask_worker.status.name, rss / (memory.memory_limit * memory.memory_pause_fraction)


@pytest.mark.slow
def test_a_tail_cut_on_one_vllm_worker_resumes_there_or_continues_on_another(tiny_model_dir):
    """The elastic policy's chunk tasks on vLLM engines in two worker processes: a shard
    cut at a quarter finished, its tail resumed where it was cut or continued on the other
    worker from its tokens so far; every (prompt, sample) lands once either way. Dask's
    worker processes are daemonic (they may not start children): each engine runs in its
    worker's own process, its load is the first task's cold start (the second task on a
    worker pays none), and closing the cluster leaves no vLLM process. vLLM's CPU engine
    takes ``gpu_memory_utilization`` of the machine's RAM (0.15 of 24 GiB is 3.6 GiB), more
    than a 3 GiB worker holds below Dask's pause fraction (80 %), and a paused worker starts
    no task (the run would wait forever): capped at what its worker may hold
    (``engine_ram_bytes``), each worker still runs, under its pause fraction."""
    from rlhfless.pipeline.tasks.rollout import continue_task, generate_chunk_task, resume_task

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    shard = read_prompts(tiny_model_dir / "train.jsonl", tok).table.slice(0, 6)
    spec = GenSpec(EngineSpec(str(tiny_model_dir), backend="vllm", dtype="float32"), 4,
                   SamplingParams(max_new_tokens=24, seed=2))
    weights = WeightsRef(0, str(tiny_model_dir))
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, memory_limit="3GiB",
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        a, b = list(client.scheduler_info()["workers"])
        out = client.submit(generate_chunk_task, shard, weights, spec, 1, 0.25, "k",
                            workers=[a], pure=False).result(timeout=TASK_TIMEOUT_S)
        cut = out["cut"]
        moved = client.submit(continue_task, cut, weights, spec, 1, workers=[b],
                              pure=False).result(timeout=TASK_TIMEOUT_S)
        stayed = client.submit(resume_task, "k", weights, spec, workers=[a],
                               pure=False).result(timeout=TASK_TIMEOUT_S)
        memory = client.run(_memory_state)
    assert all(status == "running" and share < 1 for status, share in memory.values()), memory
    assert 0 < len(cut) < 4 * len(shard)
    assert moved.stats.cold_start_s > 0 and stayed.stats.cold_start_s == 0
    every = sorted((p, s) for p in shard.column("prompt_id").to_pylist() for s in range(4))
    for rest in (moved.table, stayed.table):
        assert sorted(_pairs(out["done"].table) + _pairs(rest)) == every
        for ids, partial in zip(rest.column("response_ids").to_pylist(),
                                cut.column("partial_ids").to_pylist()):
            assert ids[:len(partial)] == partial  # continued, not restarted
    assert len(set(moved.table.column("worker").to_pylist())
               | set(stayed.table.column("worker").to_pylist())) == 2
    assert vllm_processes() == []


@pytest.mark.slow  # the engine's episodes and chunk tasks on vLLM: the tests above, in CI
def test_elastic_multi_turn_run_on_vllm(tiny_model_dir, tmp_path):
    """The elastic policy sizing a pool of vLLM engines that play multi-turn episodes (the
    tally task's lookup environment): both iterations run their episodes, the pool's
    decisions are logged, and no engine outlives the run."""
    from rlhfless.pipeline.config import Config
    from rlhfless.pipeline.train.loop import train

    cfg = Config(model=str(tiny_model_dir), runs_dir=str(tmp_path), name="vllm-elastic",
                 backend="vllm", policy="elastic", environment="tally-tool", iterations=2,
                 batch_prompts=6, n_samples=2, max_turns=2, max_turn_tokens=12,
                 max_episode_tokens=48, heldout_prompts=4, eval_every=2,
                 checkpoint_every=100, gen_workers=2, train_threads=1)
    run = train(cfg, progress=False, log=lambda *_: None)
    records = [m for m in run.metrics() if m.get("event") == "iteration"]
    assert [m["iteration"] for m in records] == [1, 2]
    assert all(m["episodes"] == 12 for m in records)
    decisions = [json.loads(line) for line in
                 (run.path / "decisions.jsonl").read_text().splitlines()]
    assert {d["kind"] for d in decisions} >= {"scale"}
    assert vllm_processes() == []

