"""Every registered engine, the same protocol tests (``ops/engine/protocol.py``): one row per
(prompt, sample) with the behaviour policy's logprobs (the trainer's own, recomputed), draws
reproducible from the seed, cut rows finished here or anywhere, weights replaced in place,
turns of episodes, the context checked. The toy engine of ``toy_engine.py`` is registered
here, as a user registers theirs, and passes the same tests; vLLM's are slow (its engine
starts in ~30 s on CPU) and run in CI's slow set. An engine that needs CUDA would be marked
so here (none does: vLLM's CPU build runs them)."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhfless.ops.data.load import read_prompts
from rlhfless.ops.data.schema import ROLLOUTS, check_columns
from rlhfless.ops.engine.engine_types import EngineSpec, SamplingParams, StopRule, Turn
from rlhfless.ops.engine.forward import response_logprobs
from rlhfless.ops.engine.gen_stats import GenerationStats
from rlhfless.ops.engine.publish import publish_weights
from rlhfless.ops.engine.registry import (
    ENGINES,
    engine_class,
    engine_names,
    make_engine,
    register_engine,
    resolved,
)

TOY = "toy_engine:ToyEngine"  # this folder is on sys.path under pytest (and a worker's)
register_engine("toy", TOY)
PARAMS = SamplingParams(max_new_tokens=10, temperature=1.0, seed=7)
# behaviour vs trainer logprobs, both float32 forwards of the same weights: they differ by
# the reduction order of the matmuls and the softmax (a few float32 ulps of logits ~10,
# ~1e-5), with margin for vLLM's fused kernels; as test_vllm_backend's LOGPROB_ATOL
LOGPROB_ATOL = 1e-4


def _engine_params():
    """Every registered engine that runs a model; the emulated one, which only keeps a
    profile's time, has its own protocol tests (tests/pipeline/tasks/test_emulated_engine.py)."""
    for name in engine_names():
        if not engine_class(name).computes:
            continue
        marks = [pytest.mark.slow] if name == "vllm" else []
        yield pytest.param(name, marks=marks, id=name)


@pytest.fixture(scope="module", params=list(_engine_params()))
def engine(request, tiny_model_dir):
    spec = EngineSpec(str(tiny_model_dir), "cpu", 1, request.param, dtype="float32",
                      gpu_memory_utilization=0.05)
    engine = make_engine(resolved(spec))  # as a worker builds it: from the target alone
    engine.load()
    yield engine
    engine.close()
    engine.close()  # a second close does nothing


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> pa.Table:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return read_prompts(tiny_model_dir / "train.jsonl", tok).table.slice(0, 3)


@pytest.fixture(scope="module")
def trainer(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _key(table: pa.Table) -> list[tuple[str, int]]:
    return list(zip(table.column("prompt_id").to_pylist(), table.column("sample_idx").to_pylist()))


def _logprob_error(table: pa.Table, model) -> float:
    behaviour = table.column("logprobs").to_pylist()
    with torch.no_grad():
        trainer, scored = response_logprobs(model, table.column("prompt_ids").to_pylist(),
                                            table.column("response_ids").to_pylist(), 0,
                                            PARAMS.temperature, 1.0)
    got = torch.zeros_like(trainer)
    for i, lp in enumerate(behaviour):
        got[i, : len(lp)] = torch.tensor(lp)
    return float((got - trainer)[scored].abs().max())


def test_the_toy_is_registered_as_a_user_would_and_reaches_workers_by_its_target():
    assert ENGINES["toy"] == TOY and resolved(EngineSpec("m", backend="toy")).backend == TOY


def test_generate_gives_a_row_per_sample_with_the_trainers_logprobs(engine, prompts, trainer):
    table, stats = engine.generate(prompts, 2, PARAMS, worker="w")
    check_columns(table, ROLLOUTS, "conformance")
    expected = [(p, s) for p in prompts.column("prompt_id").to_pylist() for s in range(2)]
    assert _key(table) == expected
    ids, lps = table.column("response_ids").to_pylist(), table.column("logprobs").to_pylist()
    assert all(0 < len(i) == len(lp) <= PARAMS.max_new_tokens for i, lp in zip(ids, lps))
    assert all(math.isfinite(x) and x <= 0 for lp in lps for x in lp)
    assert set(table.column("worker").to_pylist()) == {"w"}
    assert set(table.column("policy_version").to_pylist()) == {engine.version}
    assert set(table.column("finish_reason").to_pylist()) <= {"stop", "length"}
    assert _logprob_error(table, trainer) <= LOGPROB_ATOL
    again, _ = engine.generate(prompts, 2, PARAMS, worker="w")
    assert again.column("response_ids").to_pylist() == ids  # the seed keys every draw


def test_cut_rows_finish_here_and_anywhere(engine, prompts, trainer):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=11)
    chunk = engine.generate_until(prompts, 2, params, StopRule(deadline=0.0))  # cut at once
    assert len(chunk.done) + len(chunk.cut) == 6 and len(chunk.cut) > 0
    assert "partial_ids" in chunk.cut.column_names
    resumed, _ = engine.resume(chunk.paused, params)
    moved, _ = engine.continue_rows(chunk.cut, params)
    for finished in (resumed, moved):
        assert sorted(_key(finished) + _key(chunk.done)) == sorted(
            (p, s) for p in prompts.column("prompt_id").to_pylist() for s in range(2))
        assert _logprob_error(finished, trainer) <= LOGPROB_ATOL
    partial = dict(zip(_key(chunk.cut), chunk.cut.column("partial_ids").to_pylist()))
    for key, ids in zip(_key(moved), moved.column("response_ids").to_pylist()):
        assert ids[: len(partial[key])] == partial[key]  # a continuation keeps its tokens


def test_set_weights_replaces_them_in_place(engine, prompts, tiny_model_dir, tmp_path):
    before, _ = engine.generate(prompts, 1, PARAMS)
    changed = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in changed.parameters():
            weight.add_(0.05 * torch.randn(weight.shape, generator=generator))
    engine.set_weights(publish_weights(changed, tmp_path, 3))
    after, _ = engine.generate(prompts, 1, PARAMS)
    assert engine.version == 3 and set(after.column("policy_version").to_pylist()) == {3}
    assert _logprob_error(after, changed.eval()) <= LOGPROB_ATOL  # sampled from the new ones
    assert after.column("logprobs").to_pylist() != before.column("logprobs").to_pylist()
    engine.set_weights(publish_weights(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), tmp_path, 4))
    back, _ = engine.generate(prompts, 1, PARAMS)  # the first weights again, for what follows
    assert back.column("response_ids").to_pylist() == before.column("response_ids").to_pylist()


def test_turns_each_get_a_result_and_leave_once(engine, prompts):
    turns = [Turn(list(ids), budget=5, key=k)
             for k, ids in enumerate(prompts.column("prompt_ids").to_pylist())]
    left, at_leave = [], {}

    def leave(i: int, ids: list[int]) -> None:
        left.append((i, list(ids)))
        at_leave[i] = turns[i].result  # set by then: an agent's request is answered with it

    engine.decode_turns(turns, PARAMS, GenerationStats(), on_leave=leave)
    assert sorted(i for i, _ in left) == list(range(len(turns)))
    for i, turn in enumerate(turns):
        ids, lps, finish = turn.result
        assert 0 < len(ids) == len(lps) <= 5 and finish in ("stop", "length")
        assert dict(left)[i] == ids
        assert at_leave[i] == turn.result


def test_the_context_is_checked_and_a_step_is_timed(engine):
    with pytest.raises(ValueError, match="exceeds the model's context"):
        engine.check_context(engine.max_context + 1)
    assert engine.step_seconds(batch=2, steps=2, prompt_tokens=4) > 0
