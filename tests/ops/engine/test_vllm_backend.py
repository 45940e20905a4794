"""The vllm backend on a real vLLM engine and a CUDA device, with the tiny Llama.

Runs where ``import vllm`` works and a GPU is visible (the ``vllm`` extra on a GPU machine);
skips everywhere else, saying which of the two is missing.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhfless.ops.data.load import read_prompts
from rlhfless.ops.engine.generate import SamplingParams
from rlhfless.ops.engine.publish import publish_weights

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'rlhfless[vllm]' on "
                                   "a CUDA machine)")
if not torch.cuda.is_available():
    pytest.skip("vLLM is installed but no CUDA device is visible", allow_module_level=True)

from rlhfless.ops.engine.vllm_backend import VLLMBackend  # noqa: E402

N = 4
PARAMS = SamplingParams(max_new_tokens=16, temperature=1.0, seed=1)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    backend = VLLMBackend(tiny_model_dir, colocate=True, gpu_memory_utilization=0.2,
                          max_model_len=256)
    backend.load()
    return backend


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return read_prompts(tiny_model_dir / "train.jsonl", tok).table.slice(0, 6)


def _recomputed_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / PARAMS.temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response, device=model.device)
                                                [:, None]).squeeze(-1).cpu()


def test_n_samples_per_prompt_with_the_trainers_logprobs(engine, prompts, tiny_model_dir):
    table, stats = engine.generate(prompts, N, PARAMS)
    assert len(table) == N * len(prompts) and stats.decode_tokens > 0
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda()
    for p, r, lp in zip(table.column("prompt_ids").to_pylist(),
                        table.column("response_ids").to_pylist(),
                        table.column("logprobs").to_pylist()):
        assert 0 < len(r) == len(lp) <= PARAMS.max_new_tokens
        torch.testing.assert_close(torch.tensor(lp), _recomputed_logprobs(model, p, r),
                                   atol=5e-2, rtol=0)  # bf16 engine vs fp32 recompute


def test_weight_update_in_place_changes_greedy_output_and_resets_cache(engine, prompts,
                                                                        tiny_model_dir,
                                                                        tmp_path):
    greedy = SamplingParams(max_new_tokens=16, greedy=True)
    before = engine.generate(prompts, 1, greedy)[0].column("response_ids").to_pylist()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn_like(p) * 0.5)
    engine.sleep()  # colocated: the update arrives while the engine sleeps
    engine.set_weights(publish_weights(model, tmp_path, 1))
    after, _ = engine.generate(prompts, 1, greedy)
    assert engine.version == 1 and set(after.column("policy_version").to_pylist()) == {1}
    assert after.column("response_ids").to_pylist() != before
