"""End to end on a real LocalCluster with worker processes and the quick tiny model."""

from __future__ import annotations

from collections import Counter

import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfless.pipeline.config import Config
from rlhfless.pipeline.durable.runs import RunDir, RunDirError
from rlhfless.pipeline.durable.sampler import PromptSampler
from rlhfless.pipeline.train.loop import train


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


def _ids(n: int):
    import pyarrow as pa

    return pa.table({"prompt_id": [f"p{i}" for i in range(n)]})


@pytest.mark.parametrize(("n_prompts", "batch"), [(100, 32), (10, 8), (8, 8), (9, 8), (3, 1)])
def test_a_batch_never_repeats_a_prompt_across_epochs(n_prompts, batch):
    """100 prompts, batch 32: the fourth batch crossed into epoch 2 and held a prompt twice."""
    sampler = PromptSampler(_ids(n_prompts), batch, seed=0)
    stream = []
    for _ in range(40):
        drawn = sampler.next_batch().column("prompt_id").to_pylist()
        assert len(set(drawn)) == batch, (len(stream) // batch + 1, Counter(drawn).most_common(1))
        stream += drawn
    for epoch in range(len(stream) // n_prompts):  # every epoch still holds every prompt once
        assert sorted(stream[epoch * n_prompts:(epoch + 1) * n_prompts]) == sorted(
            f"p{i}" for i in range(n_prompts))


@settings(max_examples=60, deadline=None)
@given(n_prompts=st.integers(1, 30), data=st.data(), seed=st.integers(0, 3))
def test_any_batch_sizes_stay_distinct_and_resume_from_the_position(n_prompts, data, seed):
    """Replay mode draws fewer than a batch; a resumed run rebuilds the order from position."""
    batch = data.draw(st.integers(1, n_prompts))
    sizes = data.draw(st.lists(st.integers(1, batch), min_size=1, max_size=12))
    sampler = PromptSampler(_ids(n_prompts), batch, seed=seed)
    for i, n in enumerate(sizes):
        position = sampler.position
        drawn = sampler.next_batch(n).column("prompt_id").to_pylist()
        assert len(set(drawn)) == n
        resumed = PromptSampler(_ids(n_prompts), batch, seed=seed)
        resumed.position = position
        assert resumed.next_batch(n).column("prompt_id").to_pylist() == drawn, i


def test_a_dataset_smaller_than_a_batch_is_refused():
    with pytest.raises(ValueError, match="5 prompts, fewer than a batch of 8"):
        PromptSampler(_ids(5), 8, seed=0)
    with pytest.raises(ValueError, match="at most a batch of 4"):
        PromptSampler(_ids(10), 4, seed=0).next_batch(5)


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
        assert m["lr"] == cfg.lr  # sync updates at lr itself
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
    # each version's bytes as published: the file the store holds (both kept: keep_weights 2)
    assert [m["weights_bytes"] for m in iterations] == [
        (run.weights / f"v{it}.safetensors").stat().st_size for it in (1, 2)]


def test_existing_run_directory_is_not_overwritten(tmp_path):
    cfg = Config(runs_dir=str(tmp_path), name="taken")
    RunDir.create(cfg).release()
    (tmp_path / "taken" / "metrics.jsonl").write_text('{"event": "iteration"}\n')
    with pytest.raises(RunDirError, match="--overwrite"):
        RunDir.create(cfg)
