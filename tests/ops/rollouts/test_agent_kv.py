"""KV kept across an agent episode's requests on our engine (``agent_server.py``,
``ops/engine/turns.py``): a request that continues the last one runs only its new ids, one
that re-renders part of the history runs from where it departs, and what either samples has
the logprobs of a from-scratch prefill of its whole prompt.

Tolerance: the model runs in float64, so no near-tie flips a draw between the two paths, and
the two prefills' logits differ by float64 reassociation alone (a sum of n <= 256 terms:
n * 2**-53 < 1e-13 of max|z|). The engine takes a sampled token's
logprob in float32 (``log_softmax(logits.float())``), so each recorded logprob is the
float64 one within what that adds, u = 2**-24 each step: casting the V logits (u|z_t| and,
through the log-sum-exp, u max|z|), ``z_t - max z`` (u 2 max|z|), exp and a sum of V terms
(at worst (V - 1) u relative, u V once logged), the log (u log V) and the last subtraction
(u |lp|): at most u (4 max|z| + V + log V + |lp|) per token, with max|z| and V (the
vocabulary) read from the float64 logits; plus the float64 gap, 1e-13 max|z|."""

from __future__ import annotations

import math

import openai
import torch

from rlhfless.ops.engine.engine_types import SamplingParams
from rlhfless.ops.engine.gen_stats import GenerationStats

ASK = [{"role": "user", "content": "Items: fig pear plum\nHow many items?"}]
U = 2.0**-24  # float32 unit roundoff


def _shared(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _request(server, client, messages: list[dict]) -> tuple[dict, GenerationStats]:
    """The answer to ``messages`` and what the engine prefilled for it."""
    server.stats = stats = GenerationStats()
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=8)
    return reply.choices[0].message.model_dump(exclude_none=True,
                                               include={"role", "content"}), stats


def test_a_continued_request_prefills_only_its_new_ids_with_from_scratch_logprobs(
        server, engine):
    server.set_engine(engine, SamplingParams(max_new_tokens=8, seed=4), None)
    token = server.open_episode(9)
    client = openai.OpenAI(base_url=server.base_url, api_key=token, max_retries=0, timeout=30)
    first, _ = _request(server, client, ASK)
    follow_up = ASK + [first, {"role": "user", "content": "And with a kiwi?"}]
    _, continued = _request(server, client, follow_up)
    # history re-rendered from text (the answer's ids tokenized again), a new question after
    drifted = ASK + [{"role": "assistant", "content": first["content"] + " 3"},
                     {"role": "user", "content": "Sure?"}]
    _, redone = _request(server, client, drifted)
    calls = server.close_episode(token)
    assert len(calls) == 3
    for (before, now), stats in zip(zip(calls, calls[1:]), (continued, redone)):
        ids = before.samples[0][0]
        seen = before.prompt_ids + ids[:-1]  # the last sampled id never ran through the model
        kept = min(_shared(now.prompt_ids, seen), len(now.prompt_ids) - 1)
        assert kept >= len(ASK[0]["content"]) // 4  # the question's tokens at least
        assert (stats.prefill_reused_tokens, stats.prefill_tokens, stats.prefill_requests) \
            == (kept, len(now.prompt_ids) - kept, 1)
    # the continued request extended the first exactly: only its new ids and the last
    # sampled one ran
    p1, s1 = calls[0].prompt_ids, calls[0].samples[0][0]
    assert calls[1].prompt_ids[:len(p1) + len(s1)] == p1 + s1
    assert continued.prefill_tokens == len(calls[1].prompt_ids) - len(p1) - len(s1) + 1
    for call in calls:
        ids, logprobs, _ = call.samples[0]
        scratch, bound = _from_scratch(engine.model, call.prompt_ids, ids)
        gap = (torch.tensor(logprobs, dtype=torch.float64) - scratch).abs()
        assert bool((gap <= bound).all()), (gap - bound).max()


@torch.no_grad()
def _from_scratch(model, prompt: list[int], ids: list[int]) -> tuple[torch.Tensor,
                                                                     torch.Tensor]:
    """The logprob of each of ``ids`` after ``prompt`` from one float64 forward of the whole
    sequence (no cache), and the float32 bound of the module docstring on each."""
    logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
    logp = logits.double().log_softmax(-1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    vocab = logits.shape[-1]
    top = logits.abs().amax(-1).double()
    return logp, U * (4 * top + vocab + math.log(vocab) + logp.abs()) + 1e-13 * top
