"""A LoRA run on a vLLM generation worker end to end (vLLM's CPU build here and in CI): the
trainer publishes each version as its adapter alone and the engine generates with it, so the
behaviour logprobs of iteration 2's rows (drawn by version 1) are those of the base model
with version 1's adapter, recomputed here by our transformers model; no full weights are
published. Tolerance as in ``tests/ops/engine/test_vllm_lora.py``."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch
from test_vllm_backend import LOGPROB_ATOL, _max_logprob_error
from transformers import AutoModelForCausalLM
from vllm_support import require_vllm, vllm_processes

from rlhfless.ops.engine.engine_types import WeightsRef
from rlhfless.ops.engine.lora import LoraSpec, add_adapters
from rlhfless.ops.engine.publish import load_weights

require_vllm()

SPEC = LoraSpec(rank=4, alpha=8.0)


@pytest.mark.slow  # a cluster, a vLLM worker and two updates: ~100 s on 2 busy cores
def test_a_lora_run_on_vllm_generates_with_each_published_adapter(tiny_model_dir, tmp_path):
    from rlhfless.pipeline.config import Config
    from rlhfless.pipeline.train.loop import train

    cfg = Config(model=str(tiny_model_dir), runs_dir=str(tmp_path), name="vllm-lora",
                 backend="vllm", iterations=2, batch_prompts=4, n_samples=4, max_new_tokens=8,
                 heldout_prompts=4, eval_every=100, checkpoint_every=100, gen_workers=1,
                 train_threads=1, rewards={"tally": "parity_reward:parity"},
                 lora_rank=SPEC.rank, lora_alpha=SPEC.alpha, lr=0.05)
    run = train(cfg, progress=False, log=lambda *_: None)
    records = [m for m in run.metrics() if m.get("event") == "iteration"]
    assert [m["policy_version"] for m in records] == [0, 1]
    assert sorted(p.name for p in (run.path / "weights").iterdir()) == ["v1", "v2"]
    rows = pq.read_table(run.path / "rollouts" / "iter-00002.parquet")
    assert set(rows.column("policy_version").to_pylist()) == {1}
    torch.manual_seed(0)
    policy = add_adapters(AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                               dtype=torch.float32), SPEC)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    load_weights(policy, WeightsRef(1, str(run.path / "weights" / "v1")))
    assert _max_logprob_error(rows, policy, cfg.temperature) < LOGPROB_ATOL
    assert _max_logprob_error(rows, base, cfg.temperature) > LOGPROB_ATOL * 10
    assert vllm_processes() == []
