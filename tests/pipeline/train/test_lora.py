"""LoRA through peft: only the adapters train, are published (a PEFT adapter directory per
version) and checkpointed; a run with adapters on 2 FSDP2 ranks (LocalCluster, gloo)
publishes adapter bytes only, and its export folds them into plain weights that compute what
the trained policy computes."""

from __future__ import annotations

import json

import pytest
import torch
import zarr
from safetensors.torch import load_file
from test_ranks import PARAMS, trainable
from transformers import AutoModelForCausalLM

from rlhfless.ops.algo.update import update_policy
from rlhfless.ops.engine.engine_types import WeightsRef
from rlhfless.ops.engine.lora import (
    LoraSpec,
    adapter_bytes,
    add_adapters,
    from_peft_state,
    is_adapter,
)
from rlhfless.ops.engine.publish import ADAPTER_FILE, load_weights, publish_weights
from rlhfless.pipeline.config import Config, ConfigError
from rlhfless.pipeline.durable.checkpoint import find
from rlhfless.pipeline.durable.export import export_hf
from rlhfless.pipeline.train.loop import train

SPEC = LoraSpec(rank=4, alpha=8.0)


def adapted(model_dir) -> torch.nn.Module:
    torch.manual_seed(0)
    return add_adapters(AutoModelForCausalLM.from_pretrained(model_dir), SPEC)


def test_update_trains_and_publishes_only_adapters(tiny_model_dir, tmp_path):
    model = adapted(tiny_model_dir)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=PARAMS.lr)
    update_policy(model, optimizer, trainable(), PARAMS, pad_id=0)
    after = model.state_dict()
    changed = {n for n in after if not torch.equal(after[n], before[n])}
    assert changed and all(is_adapter(n) for n in changed)
    assert any(".lora_B." in n for n in changed)  # B leaves zero: the policy moved
    ref = publish_weights(model, tmp_path, 1)
    published = from_peft_state(load_file(f"{ref.path}/{ADAPTER_FILE}"))
    assert published and all(is_adapter(n) for n in published)
    full = sum(t.numel() * t.element_size() for t in AutoModelForCausalLM.from_pretrained(
        tiny_model_dir).state_dict().values())
    assert adapter_bytes(published) < full / 10
    generator = adapted(tiny_model_dir)  # another process's engine: its own A, B = 0
    load_weights(generator, WeightsRef(1, ref.path))
    ids = torch.tensor([[5, 9, 17, 3, 44]])
    with torch.no_grad():
        torch.testing.assert_close(generator(input_ids=ids).logits, model(input_ids=ids).logits)


def test_bad_lora_settings_are_one_line_errors():
    with pytest.raises(ConfigError, match="lora_rank"):
        Config(lora_rank=-1)
    with pytest.raises(ConfigError, match="lora_rank"):
        Config(lora_rank=4, lora_target_modules=[])
    with pytest.raises(ConfigError, match=r"backend = 'vllm': lora_target_modules \['lm_head'\]"):
        Config(lora_rank=4, backend="vllm", lora_target_modules=["q_proj", "lm_head"])
    with pytest.raises(ConfigError, match="backend = 'vllm': lora_rank = 1024"):
        Config(lora_rank=1024, backend="vllm")
    assert Config(lora_rank=4, backend="vllm").lora_rank == 4


@pytest.mark.slow
def test_lora_run_on_two_ranks_publishes_and_checkpoints_adapters(tiny_model_dir, tmp_path):
    cfg = Config(model=str(tiny_model_dir), runs_dir=str(tmp_path), name="lora",
                 iterations=2, batch_prompts=4, n_samples=4, max_new_tokens=16,
                 heldout_prompts=4, eval_every=100, gen_workers=1, train_threads=1,
                 rewards={"tally": "parity_reward:parity"}, lora_rank=SPEC.rank,
                 lora_alpha=SPEC.alpha, train_workers=2, lr=1e-2)
    run = train(cfg, progress=False, log=lambda *_: None).path
    published = from_peft_state(load_file(run / "weights" / "v2" / ADAPTER_FILE))
    assert published and all(is_adapter(n) for n in published)
    assert any(t.abs().max() > 0 for n, t in published.items() if ".lora_B." in n)
    stored = zarr.open_group(find(run), mode="r")["trainer"]
    assert all(is_adapter(n) for n, _ in stored["model"].arrays())
    assert all(is_adapter(n) for n, _ in stored["optimizer"].groups())
    policy = adapted(tiny_model_dir)
    load_weights(policy, WeightsRef(2, str(run / "weights" / "v2")))
    exported = AutoModelForCausalLM.from_pretrained(export_hf(find(run), tmp_path / "hf"))
    ids = torch.tensor([[5, 9, 17, 3, 44]])
    with torch.no_grad():  # float64 forwards: merged and unmerged adapters differ by the
        # merge's float32 rounding only, not by a float32 forward's accumulation order
        torch.testing.assert_close(exported.double()(input_ids=ids).logits,
                                   policy.double()(input_ids=ids).logits, rtol=1e-5, atol=1e-6)
    assert json.loads((run / "config.json").read_text())["lora_rank"] == SPEC.rank
