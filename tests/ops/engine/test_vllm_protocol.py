"""The engine protocol's chunked and multi-turn calls on a real vLLM engine (the CPU build
here and in CI): ``generate_until`` cuts at a stop rule with each cut row's tokens and
logprobs so far, ``continue_rows`` / ``resume`` finish them from there, and episodes are the
sampled ids and the observation ids as tokenized, in order. Behaviour logprobs are checked
against the trainer's recomputation within 1e-4, argued in ``test_vllm_backend.py``.
"""

from __future__ import annotations

import time

import pytest
import torch
from episode_envs import LOG
from test_episode import runs
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm_support import require_vllm

from rlhfless.ops.data.load import read_prompts
from rlhfless.ops.engine.generate import SamplingParams
from rlhfless.ops.engine.protocol import StopRule
from rlhfless.ops.rollouts.episode import EpisodeParams, run_episodes

require_vllm()

from test_vllm_backend import LOGPROB_ATOL, _max_logprob_error  # noqa: E402

from rlhfless.ops.engine.vllm_backend import VLLMBackend  # noqa: E402

PARAMS = SamplingParams(max_new_tokens=24, temperature=1.0, seed=4)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    backend = VLLMBackend(tiny_model_dir, dtype="float32", threads=1)
    backend.load()
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def shard(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return read_prompts(tiny_model_dir / "train.jsonl", tok).table.slice(0, 8)


@pytest.fixture(scope="module")
def trainer_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def _key(table):
    return list(zip(table.column("prompt_id").to_pylist(), table.column("sample_idx").to_pylist()))


def test_cut_rows_continue_from_their_own_tokens(engine, shard, trainer_model):
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


def test_a_deadline_cuts_every_row_after_one_step(engine, shard):
    chunk = engine.generate_until(shard, 2, PARAMS, StopRule(1.0, deadline=time.perf_counter()))
    assert len(chunk.done) == 0 and len(chunk.cut) == 2 * len(shard)
    assert {len(g) for g in chunk.cut.column("partial_ids").to_pylist()} == {1}
    assert chunk.paused is not None
    assert engine.llm.llm_engine.get_num_unfinished_requests() == 0  # aborted, not running


def test_episodes_are_sampled_then_observation_ids_in_order(engine, shard, trainer_model):
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
    from rlhfless.ops.engine.forward import response_logprobs

    with torch.no_grad():
        logp, _ = response_logprobs(trainer_model, table.column("prompt_ids").to_pylist(),
                                    table.column("response_ids").to_pylist(), 0, 1.0)
    for i, row in enumerate(table.to_pylist()):
        at = [j for j, m in enumerate(row["loss_mask"]) if m]
        torch.testing.assert_close(logp[i, at], torch.tensor(row["logprobs"])[at],
                                   atol=LOGPROB_ATOL, rtol=0)
