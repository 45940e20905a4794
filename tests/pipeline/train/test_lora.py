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
from rlhfless.ops.engine.engine_types import EngineSpec, WeightsRef
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
from rlhfless.pipeline.tasks.trainer import TrainSpec, _trainer, drop_trainer, publish_task
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


def test_the_trainer_publishes_its_adapters_as_a_step_left_them(tiny_model_dir, tmp_path):
    """The trainer keeps its adapter tensors by name (the optimizer updates them in place)
    and publishes them without a state_dict: after an AdamW step, version 1 is exactly the
    adapters the model now holds, every one of them moved."""
    spec = TrainSpec(EngineSpec(str(tiny_model_dir), "cpu", 1, lora=SPEC), PARAMS,
                     str(tmp_path / "weights"))
    try:
        trainer = _trainer(spec)
        model = trainer.loaded.model
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.ones_like(p)
        trainer.optimizer.step()
        ref = publish_task({}, spec, 1)
    finally:
        drop_trainer()
    published = from_peft_state(load_file(f"{ref.path}/{ADAPTER_FILE}"))
    assert published.keys() == before.keys()
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert torch.equal(published[name], param.detach())
            assert not torch.equal(published[name], before[name])


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
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (last,) = [r for r in records if r.get("event") == "iteration" and r["iteration"] == 2]
    assert last["weights_bytes"] == sum(f.stat().st_size
                                        for f in (run / "weights" / "v2").iterdir())
    assert any(t.abs().max() > 0 for n, t in published.items() if ".lora_B." in n)
    stored = zarr.open_group(find(run), mode="r")["trainer"]
    assert all(is_adapter(n) for n, _ in stored["model"].arrays())
    assert all(is_adapter(n) for n, _ in stored["optimizer"].groups())
    exported = AutoModelForCausalLM.from_pretrained(export_hf(find(run), tmp_path / "hf"))
    merged, base = exported.state_dict(), AutoModelForCausalLM.from_pretrained(
        tiny_model_dir).state_dict()
    scale, eps = SPEC.alpha / SPEC.rank, 2.0**-24  # float32's unit roundoff
    folded = set()
    for name, a in published.items():  # the exported model is the base plus v2's adapter
        if ".lora_A." not in name:
            continue
        module = name.split(".lora_A.")[0]
        b = published[name.replace(".lora_A.", ".lora_B.")].double()
        exact = base[f"{module}.weight"].double() + scale * (b @ a.double())
        # the float32 merge: B @ A's rank-r sums (r + 1 roundings of |B| @ |A|), the scale,
        # the sum and its storing (two roundings of the result)
        bound = 2 * eps * exact.abs() + (SPEC.rank + 2) * eps * scale * (b.abs() @ a.double().abs())
        assert ((merged[f"{module}.weight"].double() - exact).abs() <= bound).all(), module
        folded.add(f"{module}.weight")
    assert folded and all(torch.equal(merged[k], base[k]) for k in merged if k not in folded)
    assert json.loads((run / "config.json").read_text())["lora_rank"] == SPEC.rank
