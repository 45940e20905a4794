"""Tests of the generation stage against real forward passes of the tiny Llama.

The reference points are a plain full forward pass over prompt + response and transformers'
own ``model.generate``; sharing prefixes, repeating the KV cache for the n samples and
dropping finished rows from the batch must change nothing but the cost.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from rlhfless.ops.data.prefix_dedup import plan_prefixes
from rlhfless.ops.data.schema import FINISH_REASONS, ROLLOUTS, check_columns
from rlhfless.ops.engine.engine_types import SamplingParams
from rlhfless.ops.engine.forward import response_logprobs, token_logprobs
from rlhfless.ops.engine.generate import generate_rollouts
from rlhfless.ops.toy.tinytask import make_prompt

MAX_NEW = 16
# template prompts of different lengths, two prompts sharing another prefix, and a lone one:
# two prefix groups of different widths next to an unshared row in one batch
TEXTS = [
    make_prompt(["fig"]),
    make_prompt(["pear", "plum", "kiwi", "lime", "olive"]),
    make_prompt(["rose", "lily"]),
    "Items: oat rye\nAnswer: 1 oat",
    "Items: oat rye\nAnswer:",
    "honey",
]


@pytest.fixture(scope="module")
def plan(make_prompts):
    return plan_prefixes(make_prompts(TEXTS), n_samples=2)


def responses(table: pa.Table) -> list[list[int]]:
    return table.column("response_ids").to_pylist()


def test_plan_shares_two_prefixes(plan):
    groups = plan.prompts.column("prefix_group").to_pylist()
    lens = plan.prompts.column("prefix_len").to_pylist()
    assert groups[0] == groups[1] == groups[2] != groups[3] == groups[4] != groups[5]
    assert lens[0] > lens[3] > 0 == lens[5]  # the template is the longer prefix


def test_greedy_with_sharing_matches_without_and_hf_generate(model64, tokenizer, plan):
    params = SamplingParams(max_new_tokens=MAX_NEW, greedy=True)
    shared, _ = generate_rollouts(model64, tokenizer, plan.prompts, 2, params, policy_version=0)
    plain, _ = generate_rollouts(model64, tokenizer, plan.prompts, 2, params, policy_version=0,
                                 share_prefixes=False)
    assert responses(shared) == responses(plain)
    assert shared.column("finish_reason").equals(plain.column("finish_reason"))

    enc = tokenizer(TEXTS, return_tensors="pt", padding=True, add_special_tokens=False)
    assert tokenizer.padding_side == "left"
    with torch.no_grad():
        out = model64.generate(**enc, do_sample=False, max_new_tokens=MAX_NEW,
                               pad_token_id=tokenizer.pad_token_id,
                               eos_token_id=tokenizer.eos_token_id)
    expected = []
    for row in out[:, enc["input_ids"].shape[1]:].tolist():
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id) + 1]
        expected.append(row)
    got = responses(shared)
    assert got[0::2] == expected  # sample 0 of each prompt
    assert got[1::2] == expected  # greedy: every sample is the same
    assert len({tuple(r) for r in expected}) == len(TEXTS)  # the prompts matter


@pytest.mark.parametrize("top_p", [1.0, 0.9])
@pytest.mark.parametrize(
    ("net", "tol"), [("model", 1e-4), ("model64", 1e-5), ("eos_model", 1e-4)]
)
def test_logprobs_match_a_full_forward_pass(request, tokenizer, plan, net, tol, top_p):
    """The behaviour logprobs equal the policy's on one unpadded forward pass per row and the
    trainer's recomputation (``response_logprobs``, each prompt once): temperature-scaled,
    renormalised over the top-p nucleus at top_p 0.9 (``policy_logprobs``).

    Tolerances: a float32 net's logprobs differ from a float64 forward by the rounding of
    four layers of width 128 carried to logits of up to ~14 after temperature, relative
    ~eps * sqrt(128) * a few per layer: 3-5e-5 measured, at either top_p (renormalising adds
    the log of the nucleus' mass, a few ulps); 1e-4 is twice that. Generation and
    ``response_logprobs`` are both such float32 passes, differing in cache and padding: the
    same bound (4.6e-5 seen at top_p 0.9, 8 samples). model64 is float64 but for
    transformers' float32 RMSNorm: 1e-5. Both sides take the same nucleus unless a
    cumulative sum falls within that rounding of 1 - top_p: a boundary token's mass, not
    noise, would then show."""
    # eos_model: rows leave the batch and the KV cache mid-decode; the rest must not notice
    net = request.getfixturevalue(net)
    temperature = 0.7
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, top_p=top_p,
                            seed=3)
    table, _ = generate_rollouts(net, tokenizer, plan.prompts, 3, params, policy_version=0)
    if net is request.getfixturevalue("eos_model"):
        assert "stop" in table.column("finish_reason").to_pylist()
    prompts, answers = table.column("prompt_ids").to_pylist(), responses(table)
    with torch.no_grad():
        trainer, scored = response_logprobs(net, prompts, answers, tokenizer.pad_token_id,
                                            temperature, top_p)
    below_full = 0.0  # how far the nucleus moved the logprobs: 0 at top_p 1
    for i, row in enumerate(table.to_pylist()):
        prompt, response = row["prompt_ids"], row["response_ids"]
        assert len(row["logprobs"]) == len(response) == int(scored[i].sum())
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = net(input_ids=ids).logits[0].double()  # [T, V]
        positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
        want = token_logprobs(logits[positions], torch.tensor(response), temperature, top_p)
        full = torch.log_softmax(logits[positions] / temperature, -1)[
            torch.arange(len(response)), torch.tensor(response)]
        got = torch.tensor(row["logprobs"], dtype=torch.float64)
        torch.testing.assert_close(got, want, atol=tol, rtol=0)
        torch.testing.assert_close(got, trainer[i, : len(response)].double(), atol=tol, rtol=0)
        below_full = max(below_full, float((got - full).max()))
    assert (below_full > 1e-2) == (top_p < 1)  # renormalising raised some token's logprob


def test_stop_and_length(eos_model, tokenizer, plan):
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=1)
    table, stats = generate_rollouts(eos_model, tokenizer, plan.prompts, 4, params,
                                     policy_version=0)
    eos = tokenizer.eos_token_id
    reasons = table.column("finish_reason").to_pylist()
    assert {"stop", "length"} <= set(reasons) <= set(FINISH_REASONS)
    for ids, reason in zip(responses(table), reasons):
        if reason == "stop":
            assert ids[-1] == eos and ids.count(eos) == 1 and len(ids) <= MAX_NEW
        else:
            assert len(ids) == MAX_NEW and eos not in ids
    # finished rows leave the batch: decode computed exactly the tokens returned
    assert stats.decode_tokens == sum(len(ids) for ids in responses(table))
    assert stats.decode_steps == max(len(ids) for ids in responses(table))


def test_sampling_is_reproducible_for_a_seed(model, tokenizer, plan):
    def run(seed: int) -> pa.Table:
        params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=seed)
        return generate_rollouts(model, tokenizer, plan.prompts, 2, params,
                                 policy_version=0)[0]

    first, again, other = run(7), run(7), run(8)
    assert responses(first) == responses(again)
    assert first.column("logprobs").equals(again.column("logprobs"))
    assert responses(first) != responses(other)
    samples = responses(first)
    assert any(samples[2 * i] != samples[2 * i + 1] for i in range(len(TEXTS)))


def test_tiny_top_p_is_greedy(model64, tokenizer, plan):
    """A nucleus of one token draws the argmax, with probability 1 under the nucleus policy;
    greedy decoding keeps the full distribution's logprobs."""
    greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7, greedy=True)
    nucleus = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.7, top_p=1e-6, seed=5)
    a, _ = generate_rollouts(model64, tokenizer, plan.prompts, 2, greedy, policy_version=0)
    b, _ = generate_rollouts(model64, tokenizer, plan.prompts, 2, nucleus, policy_version=0)
    assert responses(a) == responses(b)
    assert {x for lp in b.column("logprobs").to_pylist() for x in lp} == {0.0}
    assert max(x for lp in a.column("logprobs").to_pylist() for x in lp) < 0


def test_context_overflow_raises(model, tokenizer, ids_prompts):
    limit = model.config.max_position_embeddings
    params = SamplingParams(max_new_tokens=MAX_NEW, greedy=True)
    fits = ids_prompts([[5] * (limit - MAX_NEW), [6] * 10])
    table, _ = generate_rollouts(model, tokenizer, fits, 1, params, policy_version=0)
    assert table.num_rows == 2
    too_long = ids_prompts([[5] * (limit - MAX_NEW + 1), [6] * 10])
    with pytest.raises(ValueError, match=f"exceeds the model's context of {limit}"):
        generate_rollouts(model, tokenizer, too_long, 1, params, policy_version=0)


def test_prefill_counts_follow_the_plan(model, tokenizer, plan):
    params = SamplingParams(max_new_tokens=4, seed=0)
    _, shared = generate_rollouts(model, tokenizer, plan.prompts, 2, params, policy_version=0)
    _, plain = generate_rollouts(model, tokenizer, plan.prompts, 2, params, policy_version=0,
                                 share_prefixes=False)
    assert shared.prefill_tokens == plan.planned_prefill_tokens
    assert plain.prefill_tokens == plan.naive_prefill_tokens
    assert shared.prefill_reused_tokens == plan.saved_prefill_tokens
    assert plain.prefill_reused_tokens == 0
    assert shared.prefill_requests == plain.prefill_requests == 2 * len(plan.prompts)
    assert shared.prefill_seconds + shared.decode_seconds > 0 and shared.decode_steps <= 4


def test_rows_are_prompt_major_with_rollout_columns(model, tokenizer, plan):
    n = 3
    params = SamplingParams(max_new_tokens=4, seed=0)
    table, _ = generate_rollouts(model, tokenizer, plan.prompts, n, params, policy_version=7,
                                 worker="w-1")
    check_columns(table, ROLLOUTS, "test")
    assert table.num_rows == n * len(TEXTS)
    ids = plan.prompts.column("prompt_id").to_pylist()
    assert table.column("prompt_id").to_pylist() == [p for p in ids for _ in range(n)]
    assert table.column("sample_idx").to_pylist() == list(range(n)) * len(TEXTS)
    assert table.column("prompt_ids").to_pylist() == [
        p for p in plan.prompts.column("prompt_ids").to_pylist() for _ in range(n)
    ]
    assert set(table.column("policy_version").to_pylist()) == {7}
    assert set(table.column("worker").to_pylist()) == {"w-1"}
    assert "prefix_group" in table.column_names  # extra prompt columns are kept
    texts = table.column("response_text").to_pylist()
    assert texts == tokenizer.batch_decode(responses(table), skip_special_tokens=True)
    start, end = table.column("gen_start").to_pylist(), table.column("gen_end").to_pylist()
    assert all(s <= e for s, e in zip(start, end))


def test_empty_shard_gives_an_empty_rollout_table(model, tokenizer, plan):
    params = SamplingParams(max_new_tokens=4)
    table, stats = generate_rollouts(model, tokenizer, plan.prompts.slice(0, 0), 2, params,
                                     policy_version=1)
    assert table.num_rows == 0
    check_columns(table, ROLLOUTS, "test")
    assert stats.prefill_tokens == stats.decode_tokens == 0


def test_sampling_params_are_validated():
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
