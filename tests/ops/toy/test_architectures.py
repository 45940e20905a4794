"""Real model families, built small here in each architecture (Llama, Qwen2, Qwen3, Mistral)
and saved as Hugging Face directories: each loads through the hf backend, generates, scores
its responses through the update's shared-prompt forward exactly as one unpadded forward per
row does, trains a step (fp32 and bf16 autocast, and with LoRA adapters), and names its
decoder layers for FSDP2."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch
import transformers

from rlhfless.ops.algo.parallel import decoder_layers
from rlhfless.ops.algo.update import UpdateParams, update_policy
from rlhfless.ops.data.schema import SCORED, TRAINABLE
from rlhfless.ops.engine.backend import HFBackend
from rlhfless.ops.engine.engine_types import SamplingParams
from rlhfless.ops.engine.forward import enable_checkpointing, response_logprobs
from rlhfless.ops.engine.lora import LoraSpec, is_adapter

ARCHITECTURES = ["LlamaConfig", "Qwen2Config", "Qwen3Config", "MistralConfig"]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model_dir(request, tokenizer, tmp_path_factory):
    config = getattr(transformers, request.param)(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # spread the logits so responses depend on the prompt
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def per_row_logprobs(model, prompts, responses) -> list[torch.Tensor]:
    out = []
    for p, r in zip(prompts, responses):
        logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:-1]
        out.append(torch.log_softmax(logits.double(), -1).gather(
            -1, torch.tensor(r)[:, None]).squeeze(-1))
    return out


@pytest.mark.parametrize("lora", [False, True])
def test_architecture_generates_and_trains(model_dir, make_prompts, lora):
    engine = HFBackend(model_dir, "cpu", 1, LoraSpec(4, 8.0) if lora else None)
    engine.load()
    engine.version = 0
    model = engine.model
    assert decoder_layers(model) and len(decoder_layers(model)) == 2
    rollouts, _ = engine.generate(make_prompts(["a b c d", "e f g h i j"]), 2,
                                  SamplingParams(max_new_tokens=8, seed=3))
    prompts = rollouts.column("prompt_ids").to_pylist()
    responses = rollouts.column("response_ids").to_pylist()
    assert all(responses)
    with torch.no_grad():
        shared, mask = response_logprobs(model, prompts, responses, 0, 1.0)
        for row, want in enumerate(per_row_logprobs(model, prompts, responses)):
            torch.testing.assert_close(shared[row][mask[row]].double(), want, rtol=1e-4,
                                       atol=1e-4)
            torch.testing.assert_close(  # the behaviour logprobs of generation, too
                torch.tensor(rollouts.column("logprobs")[row].as_py()).double(), want,
                rtol=1e-4, atol=1e-4)
    n = len(rollouts)
    table = rollouts.append_column(SCORED.field("reward"), pa.array([1.0, 0.0] * (n // 2)))
    table = table.append_column(SCORED.field("reward_error"), pa.nulls(n, pa.string()))
    table = table.append_column(TRAINABLE.field("advantage"),
                                pa.array([1.0, -0.5] * (n // 2), pa.float32()))
    for bf16 in (False, True):
        before = {k: v.clone() for k, v in model.state_dict().items()}
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                      lr=1e-2)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            metrics = update_policy(model, optimizer, table, UpdateParams(), 0)
        assert metrics["grad_norm"] > 0
        changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
        assert changed and all(is_adapter(k) for k in changed) == lora
        assert all(v.dtype == torch.float32 for v in model.state_dict().values())


def test_gradient_checkpointing_gives_the_shared_forwards_gradients(model_dir):
    """Checkpointed layers run rows whole (no KV cache); same log-probs and gradients."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).train()
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10]]
    responses = [[11, 12, 13], [14], [15, 16, 17, 18, 19]]
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            enable_checkpointing(model)
        model.zero_grad()
        logp, mask = response_logprobs(model, prompts, responses, 0, 0.7)
        logp[mask].sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        if not checkpointing:
            want = logp.detach()
    torch.testing.assert_close(logp[mask].detach(), want[mask], rtol=1e-5, atol=1e-5)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-4, atol=1e-5)
