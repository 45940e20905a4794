"""End to end on a real LocalCluster with worker processes and the quick tiny model."""

from __future__ import annotations

from collections import Counter

import pyarrow.parquet as pq
import pytest

from rlhfless.pipeline.config import Config
from rlhfless.pipeline.loop import PromptSampler, train
from rlhfless.pipeline.runs import RunDir, RunDirError


def test_sampler_is_seeded_and_covers_each_epoch(tiny_model_dir):
    import pyarrow as pa

    prompts = pa.table({"prompt_id": [f"p{i}" for i in range(10)]})
    a, b = PromptSampler(prompts, 4, seed=1), PromptSampler(prompts, 4, seed=1)
    first = [a.next_batch().column("prompt_id").to_pylist() for _ in range(5)]
    assert first == [b.next_batch().column("prompt_id").to_pylist() for _ in range(5)]
    flat = [p for batch in first for p in batch]
    assert sorted(flat[:10]) == sorted(f"p{i}" for i in range(10))  # epoch 1: each once
    assert sorted(flat[10:20]) == sorted(f"p{i}" for i in range(10))  # epoch 2: each once
    assert a.position == 20


def test_training_run_yields_every_sample_once(tiny_model_dir, tmp_path):
    cfg = Config(model=str(tiny_model_dir), runs_dir=str(tmp_path), iterations=2,
                 batch_prompts=6, n_samples=3, max_new_tokens=12, heldout_prompts=8,
                 eval_every=1, gen_workers=2, train_threads=1)
    run = train(cfg, progress=False, log=lambda *_: None)
    assert isinstance(run, RunDir)
    metrics = run.metrics()
    iterations = [m for m in metrics if m.get("event") == "iteration"]
    evals = [m for m in metrics if m.get("event") == "eval"]
    assert [m["iteration"] for m in iterations] == [1, 2]
    assert [m["policy_version"] for m in evals] == [0, 1, 2]
    for m in iterations:
        assert m["samples"] == 18
        assert m["prefill_tokens_saved"] > 0  # the n samples and the template share
        assert m["generate_busy_s"] > 0 and m["update_busy_s"] > 0
        for key in ("reward_mean", "loss", "response_len_mean", "response_len_cv",
                    "grad_norm", "dedup_wall_s", "publish_wall_s"):
            assert key in m, key
    for it in (1, 2):
        table = pq.read_table(run.path / "rollouts" / f"iter-{it:05d}.parquet")
        pairs = Counter(zip(table.column("prompt_id").to_pylist(),
                            table.column("sample_idx").to_pylist()))
        assert len(pairs) == 18 and set(pairs.values()) == {1}
        assert set(table.column("policy_version").to_pylist()) == {it - 1}
        assert len(set(table.column("worker").to_pylist())) == 2  # both generation workers
    assert (run.weights / "v2.safetensors").exists()


def test_existing_run_directory_is_not_overwritten(tmp_path):
    cfg = Config(runs_dir=str(tmp_path), name="taken")
    RunDir.create(cfg).release()
    (tmp_path / "taken" / "metrics.jsonl").write_text('{"event": "iteration"}\n')
    with pytest.raises(RunDirError, match="--overwrite"):
        RunDir.create(cfg)
