"""LoRA on a real vLLM engine (vLLM's CPU build here and in CI): the engine loads the base
once, each published version arrives as a PEFT adapter directory and runs as a
``LoRARequest``; its behaviour logprobs are the trainer's (our transformers model with the
same adapter), version after version, while at most ``max_loras`` adapters stay loaded and
no full weights are published or loaded again.

Tolerance: both sides are float32 (epsilon 1.2e-7). The adapter adds to each projection
``scale · B (A x)`` (reductions of width 4 and 128-384) onto the base projection, in another
order than the trainer's; with adapters this large (they move the logprobs by ~2.7 from the
base model's) the activations and logits grow, and a few ulps of them through four layers
and a log-softmax over ~400 tokens came to at most 1.9e-5 here (the base model alone:
~2e-6, ``test_vllm_backend.py``). ``LOGPROB_ATOL`` (1e-4, the acceptance figure) keeps a
factor of 5; an adapter that did not reach vLLM misses by over ``MOVED`` (0.05).
"""

from __future__ import annotations

import pytest
import torch
from test_vllm_backend import LOGPROB_ATOL, _max_logprob_error
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm_support import require_vllm

from rlhfless.ops.data.load import read_prompts
from rlhfless.ops.engine.engine_types import SamplingParams, WeightsRef
from rlhfless.ops.engine.lora import LoraSpec, add_adapters
from rlhfless.ops.engine.publish import ADAPTER_CONFIG, ADAPTER_FILE, publish_weights

require_vllm()

from rlhfless.ops.engine.vllm_backend import VLLMBackend  # noqa: E402

SPEC = LoraSpec(rank=4, alpha=8.0)
KEPT = 2  # max_loras: max_staleness + 2 with max_staleness = 0
MOVED = 0.05
PARAMS = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    backend = VLLMBackend(tiny_model_dir, dtype="float32", threads=1, lora=SPEC,
                          max_loras=KEPT)
    backend.load()
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return read_prompts(tiny_model_dir / "train.jsonl", tok).table.slice(0, 8)


def set_adapters(model: torch.nn.Module, seed: int) -> None:
    """Every adapter's A and B to values drawn under ``seed`` (B non-zero: the policy moves)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)


def loaded_ids(engine) -> set[int]:
    return set(engine.llm.llm_engine.list_loras())


def test_each_version_is_an_adapter_with_the_trainers_logprobs(engine, prompts, tiny_model_dir,
                                                              tmp_path):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trainer = add_adapters(AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                                dtype=torch.float32), SPEC)
    table, _ = engine.generate(prompts, 2, PARAMS)  # version 0: the base, no adapter
    assert engine.lora_request is None and _max_logprob_error(table, trainer, 1.0) < LOGPROB_ATOL
    for version in range(1, 5):
        set_adapters(trainer, seed=version)
        ref = publish_weights(trainer, tmp_path, version, keep=KEPT)
        assert {p.name for p in (tmp_path / f"v{version}").iterdir()} == {ADAPTER_CONFIG,
                                                                          ADAPTER_FILE}
        engine.set_weights(ref)
        table, _ = engine.generate(prompts, 2, PARAMS)
        assert set(table.column("policy_version").to_pylist()) == {version}
        assert _max_logprob_error(table, trainer, 1.0) < LOGPROB_ATOL
        assert _max_logprob_error(table, base, 1.0) > MOVED  # the adapter reached vLLM
        assert loaded_ids(engine) == {v + 1 for v in range(max(1, version - KEPT + 1),
                                                            version + 1)}
    # the base was loaded once: only adapter directories were published and loaded
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v3", "v4"]
    assert engine.weight_loads == 0 and len(loaded_ids(engine)) == KEPT


def test_a_loaded_version_comes_back_without_a_load(engine, prompts, tiny_model_dir, tmp_path):
    """Back to the previous version (still loaded) and on: the adapters loaded are the
    newest ``KEPT`` of the versions used, and generation uses the chosen one."""
    trainer = add_adapters(AutoModelForCausalLM.from_pretrained(tiny_model_dir,
                                                                dtype=torch.float32), SPEC)
    refs = {}
    for version in (5, 6):
        set_adapters(trainer, seed=version)
        refs[version] = publish_weights(trainer, tmp_path, version, keep=KEPT)
        engine.set_weights(refs[version])
    engine.set_weights(refs[5])
    assert loaded_ids(engine) == {6, 7} and engine.lora_request.lora_int_id == 6
    set_adapters(trainer, seed=5)
    table, _ = engine.generate(prompts, 1, PARAMS)
    assert _max_logprob_error(table, trainer, 1.0) < LOGPROB_ATOL
    engine.set_weights(WeightsRef(0, str(tiny_model_dir)))
    assert engine.lora_request is None and engine.version == 0


def test_full_weights_or_unserved_modules_are_one_line_errors(engine, tiny_model_dir, tmp_path):
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match="takes adapter directories"):
        engine.set_weights(publish_weights(plain, tmp_path, 1))
    with pytest.raises(ValueError, match=r"\['lm_head'\]: vLLM serves adapters on"):
        VLLMBackend(tiny_model_dir, lora=LoraSpec(4, 8.0, ("q_proj", "lm_head")))
    with pytest.raises(ValueError, match="rank <= 512"):
        VLLMBackend(tiny_model_dir, lora=LoraSpec(1024, 8.0))
