"""Tests of the update stage on real rollouts of the tiny Llama: the step moves the policy
the way the advantages say, micro-batching changes nothing but memory, and the KL term and
the input checks behave."""

from __future__ import annotations

import copy
import math

import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfless.ops.algo.update import UpdateParams, pack_micro_batches, update_policy
from rlhfless.ops.data.schema import SCORED, TRAINABLE, check_columns
from rlhfless.ops.engine.engine_types import SamplingParams
from rlhfless.ops.engine.forward import backward_logprobs, length_chunks, response_logprobs
from rlhfless.ops.engine.generate import generate_rollouts
from rlhfless.ops.toy.tinytask import make_prompt

N_SAMPLES = 2
TEXTS = [make_prompt(["fig"]), make_prompt(["pear", "plum", "kiwi"]), make_prompt(["oat", "rye"])]


def as_trainable(rollouts: pa.Table, advantages: list[float]) -> pa.Table:
    n = rollouts.num_rows
    table = rollouts.append_column(SCORED.field("reward"), pa.array(advantages, pa.float64()))
    table = table.append_column(SCORED.field("reward_error"), pa.nulls(n, pa.string()))
    table = table.append_column(TRAINABLE.field("advantage"), pa.array(advantages, pa.float32()))
    check_columns(table, TRAINABLE, "test")
    return table


# responses cut to these lengths (a cut rollout is still a rollout: each token's logprob
# depends only on what precedes it), so short and long responses meet in one batch
KEEP_TOKENS = [12, 3, 7, 12, 5, 10]
ADVANTAGES = [1.0, -1.0, 0.5, -2.0, 1.5, -0.5]  # sample 0 of each prompt > 0, sample 1 < 0


@pytest.fixture(scope="module")
def batch(model, tokenizer, make_prompts) -> pa.Table:
    """Rollouts at temperature 1 (the trainer's default) with hand-set advantages."""
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=11)
    rollouts, _ = generate_rollouts(model, tokenizer, make_prompts(TEXTS), N_SAMPLES, params,
                                    policy_version=0)
    for name in ("response_ids", "logprobs"):
        cut = [v[:k] for v, k in zip(rollouts.column(name).to_pylist(), KEEP_TOKENS)]
        rollouts = rollouts.set_column(rollouts.schema.get_field_index(name),
                                       rollouts.schema.field(name),
                                       pa.array(cut, rollouts.schema.field(name).type))
    return as_trainable(rollouts, ADVANTAGES)


def sequence_logprobs(net, table: pa.Table) -> list[torch.Tensor]:
    """Per row: log-probabilities [R] of the response tokens, one unpadded forward each."""
    out = []
    for prompt, response in zip(table.column("prompt_ids").to_pylist(),
                                table.column("response_ids").to_pylist()):
        ids = torch.tensor([prompt + response])
        logp = torch.log_softmax(net(input_ids=ids).logits[0].double(), dim=-1)
        positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
        out.append(logp[positions, torch.tensor(response)])
    return out


def mean_logprob_by_sign(net, table: pa.Table) -> tuple[float, float]:
    with torch.no_grad():
        per_row = sequence_logprobs(net, table)
    adv = table.column("advantage").to_pylist()
    pos = torch.cat([lp for lp, a in zip(per_row, adv) if a > 0]).mean()
    neg = torch.cat([lp for lp, a in zip(per_row, adv) if a < 0]).mean()
    return float(pos), float(neg)


def test_update_moves_the_policy_along_the_advantages(model, tokenizer, batch):
    policy = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    params = UpdateParams(clip_eps=0.2)
    pos_before, neg_before = mean_logprob_by_sign(policy, batch)

    first = update_policy(policy, optimizer, batch, params, tokenizer.pad_token_id)
    # the behaviour logprobs recorded by generation are the policy's own: ratio 1, no clip
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert first["clip_frac"] == 0.0
    lengths = [len(r) for r in batch.column("response_ids").to_pylist()]
    adv = batch.column("advantage").to_pylist()
    assert first["tokens"] == sum(lengths)
    # at ratio 1 the surrogate is minus the token-weighted mean advantage
    want = -sum(a * n for a, n in zip(adv, lengths)) / sum(lengths)
    assert first["pg_loss"] == pytest.approx(want, abs=1e-4)
    assert first["loss"] == pytest.approx(first["pg_loss"])

    metrics = [update_policy(policy, optimizer, batch, params, tokenizer.pad_token_id)
               for _ in range(3)]
    assert metrics[-1]["loss"] < first["loss"]
    assert metrics[-1]["ratio_mean"] != pytest.approx(1.0, abs=1e-4)
    pos_after, neg_after = mean_logprob_by_sign(policy, batch)
    assert pos_after > pos_before
    assert neg_after < neg_before
    assert not policy.training  # handed back in eval mode, ready to generate


def grads_after_one_step(net, table: pa.Table, budget: int, pad_id: int):
    policy = copy.deepcopy(net)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
    params = UpdateParams(micro_batch_tokens=budget, max_grad_norm=1e9)
    metrics = update_policy(policy, optimizer, table, params, pad_id)
    return {k: p.grad.clone() for k, p in policy.named_parameters()}, metrics


def test_micro_batching_gives_the_same_gradient(model64, tokenizer, batch):
    pad = tokenizer.pad_token_id
    one, m_one = grads_after_one_step(model64, batch, budget=10**6, pad_id=pad)
    many, m_many = grads_after_one_step(model64, batch, budget=1, pad_id=pad)
    assert m_one["micro_batches"] == 1
    assert m_many["micro_batches"] == batch.num_rows
    # one micro-batch shares each prompt's pass among its samples, one per row does not; the
    # sums differ only in float32 rounding (transformers' RMSNorm computes in float32 even in
    # a float64 model), hence a tolerance at float32 precision of each tensor's scale
    for name in one:
        scale = float(one[name].abs().max())
        torch.testing.assert_close(many[name], one[name], rtol=1e-5, atol=1e-6 * scale)
    for key in ("loss", "pg_loss", "ratio_mean", "clip_frac"):
        assert m_many[key] == pytest.approx(m_one[key], abs=1e-6)


def test_gradient_is_token_level_mean(model64, tokenizer, batch):
    """At ratio 1 the step's gradient is that of -sum_tokens(A * logp) / tokens in batch:
    every token weighs the same, whichever (short or long) response it is in."""
    grads, _ = grads_after_one_step(model64, batch, budget=64, pad_id=tokenizer.pad_token_id)
    reference = copy.deepcopy(model64)
    per_row = sequence_logprobs(reference, batch)
    adv = batch.column("advantage").to_pylist()
    n_tokens = sum(len(lp) for lp in per_row)
    loss = -sum(a * lp.sum() for a, lp in zip(adv, per_row)) / n_tokens
    loss.backward()
    # The trainer weighs token t by A * ratio_t / tokens in float32, where ratio_t = exp(new -
    # old) and old is the behaviour log-probability the float32 generation model recorded:
    # each weight is off by a relative eps <= max |ratio_t - 1| + a few float32 roundings. So
    # each gradient element is off by at most eps * sum_t |A * d logp_t / d theta| / tokens.
    old = [torch.tensor(v, dtype=torch.float64) for v in batch.column("logprobs").to_pylist()]
    eps = max(float((lp.detach() - o).exp().sub(1).abs().max()) for lp, o in zip(per_row, old))
    eps += 8 * torch.finfo(torch.float32).eps
    params = [p for _, p in reference.named_parameters()]
    bound = [torch.zeros_like(p) for p in params]
    for a, lp in zip(adv, sequence_logprobs(reference, batch)):  # a graph of its own
        for token_logp in lp:
            for b, g in zip(bound, torch.autograd.grad(token_logp, params, retain_graph=True,
                                                       allow_unused=True)):
                if g is not None:
                    b += abs(a) * g.abs() / n_tokens
    for (name, p), b in zip(reference.named_parameters(), bound):
        assert bool(((grads[name] - p.grad).abs() <= eps * b + 1e-12).all()), name
    # a mean per sequence first, then over sequences, would weigh tokens differently
    per_sequence = -sum(a * lp.mean() for a, lp in zip(adv, per_row)) / len(per_row)
    assert abs(float(per_sequence.detach() - loss.detach())) > 1e-3


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.tuples(st.sampled_from([(1,), (1, 2), (3, 4, 5, 6), (7,) * 9]),
                            st.integers(min_value=1, max_value=60)), max_size=40),
    budget=st.integers(min_value=1, max_value=300),
)
def test_pack_micro_batches_respects_the_budget(rows, budget):
    prompts, lengths = [list(p) for p, _ in rows], [n for _, n in rows]
    batches = pack_micro_batches(prompts, lengths, budget)
    assert sorted(i for mb in batches for i in mb) == list(range(len(rows)))
    for mb in batches:
        assert mb
        distinct = {tuple(prompts[i]) for i in mb}
        padded = (len(distinct) * max(map(len, distinct))
                  + len(mb) * max(lengths[i] for i in mb))
        assert padded <= budget or len(mb) == 1


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(min_value=1, max_value=64), max_size=60),
       slack=st.sampled_from([0.0, 0.25, 1.0]))
def test_length_chunks_bound_the_padding(lengths, slack):
    lengths = sorted(lengths)
    chunks = length_chunks(lengths, slack)
    assert [j for c in chunks for j in c] == list(range(len(lengths)))
    for c in chunks:
        rows = [lengths[j] for j in c]
        assert len(rows) * max(rows) <= (1 + slack) * sum(rows) or len(rows) == 1


def test_response_logprobs_refuses_empty_rows(model, tokenizer):
    for prompts, responses in (([[]], [[5]]), ([[5]], [[]])):
        with pytest.raises(ValueError, match="non-empty prompt and response"):
            response_logprobs(model, prompts, responses, tokenizer.pad_token_id, 1.0)


def test_samples_of_a_group_share_their_prompt_pass(model64, tokenizer, batch):
    """Log-probabilities with each prompt run once per group equal one unpadded forward per
    row, and the update counts the prompt tokens it saved."""
    prompts = batch.column("prompt_ids").to_pylist()
    responses = batch.column("response_ids").to_pylist()
    with torch.no_grad():
        logp, mask = response_logprobs(model64, prompts, responses, tokenizer.pad_token_id, 1.0)
        want = sequence_logprobs(model64, batch)
    assert mask.sum(-1).tolist() == [len(r) for r in responses]
    for row, expected in enumerate(want):
        torch.testing.assert_close(logp[row, : len(expected)].double(), expected,
                                   rtol=0, atol=1e-6)
    _, metrics = grads_after_one_step(model64, batch, budget=10**6,
                                      pad_id=tokenizer.pad_token_id)
    shared = sum(len(p) for p in {tuple(p) for p in prompts})
    assert metrics["forward_tokens"] == shared + metrics["tokens"]
    assert metrics["forward_tokens_naive"] == sum(map(len, prompts)) + metrics["tokens"]


def test_kl_to_an_identical_reference_is_zero(model, tokenizer, batch):
    policy, ref = copy.deepcopy(model), copy.deepcopy(model)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    params = UpdateParams(kl_coef=0.5)
    first = update_policy(policy, optimizer, batch, params, tokenizer.pad_token_id, ref)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)
    assert first["loss"] == pytest.approx(first["pg_loss"], abs=1e-6)
    second = update_policy(policy, optimizer, batch, params, tokenizer.pad_token_id, ref)
    assert second["kl"] > 1e-6  # the policy has moved away from the reference
    assert second["loss"] == pytest.approx(second["pg_loss"] + 0.5 * second["kl"], rel=1e-5)


def test_an_update_at_top_p_is_on_policy(model, tokenizer, make_prompts):
    """Rollouts sampled at top_p 0.9: the update's logprobs, renormalised over the same
    nucleus, are the behaviour's (ratio 1, no clip, KL 0 to the same weights); taken over
    the full distribution instead the ratio is the nucleus' mass, in [0.9, 1). Both sides
    are float32 passes over the same weights (generation's cache against the update's
    shared prompt pass): the ratio's mean is 1 within 1e-4, as at top_p 1 above."""
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=11)
    rollouts, _ = generate_rollouts(model, tokenizer, make_prompts(TEXTS), N_SAMPLES, params,
                                    policy_version=0)
    table = as_trainable(rollouts, ADVANTAGES)
    for top_p, on_policy in ((0.9, True), (1.0, False)):
        policy, ref = copy.deepcopy(model), copy.deepcopy(model)
        optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
        metrics = update_policy(policy, optimizer, table, UpdateParams(kl_coef=0.5, top_p=top_p),
                                tokenizer.pad_token_id, ref)
        if on_policy:
            assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        else:
            assert 0.9 - 1e-4 < metrics["ratio_mean"] < 1 - 1e-3
        assert metrics["clip_frac"] == 0.0
        assert metrics["kl"] == pytest.approx(0.0, abs=1e-6)


def test_tokens_outside_the_trainers_nucleus_keep_the_update_finite(model, tokenizer, batch):
    """Rollouts of the full distribution trained at a nucleus of one token: every other token
    gets LOGPROB_FLOOR, its ratio ~0 and clipped, and the step stays finite."""
    policy, ref = copy.deepcopy(model), copy.deepcopy(model)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
    metrics = update_policy(policy, optimizer, batch, UpdateParams(kl_coef=0.5, top_p=1e-6),
                            tokenizer.pad_token_id, ref)
    assert metrics["nonfinite_update"] == 0.0
    assert all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm", "kl", "ratio_mean"))
    assert metrics["clip_frac"] > 0  # the floor's ratio ~0 (and the argmax's 1 / p)


def test_kl_without_reference_raises(model, tokenizer, batch):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(ValueError, match="kl_coef > 0 needs a reference model"):
        update_policy(model, optimizer, batch, UpdateParams(kl_coef=0.1), tokenizer.pad_token_id)


def test_logprobs_of_the_wrong_length_raise(model, tokenizer, batch):
    logprobs = batch.column("logprobs").to_pylist()
    logprobs[3] = logprobs[3][:-1]
    broken = batch.set_column(batch.schema.get_field_index("logprobs"),
                              TRAINABLE.field("logprobs"),
                              pa.array(logprobs, pa.list_(pa.float32())))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    n = len(batch.column("response_ids")[3])
    with pytest.raises(ValueError, match=f"row 3 has {n} response tokens but {n - 1} logprobs"):
        update_policy(model, optimizer, broken, UpdateParams(), tokenizer.pad_token_id)


def test_missing_advantage_column_raises(model, tokenizer, batch):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(ValueError, match="missing column 'advantage'"):
        update_policy(model, optimizer, batch.drop_columns(["advantage"]), UpdateParams(),
                      tokenizer.pad_token_id)


def test_backward_per_model_call_gives_one_backwards_gradients(model64):
    """``backward_logprobs`` (a backward after each chunk, the prompt pass's last, zero-loss
    passes between) accumulates the gradients of one backward through ``response_logprobs``;
    the zero-loss passes add exact zeros."""
    prompts = [[5, 9, 11], [5, 9, 11], [5, 9, 11], [7, 8], [7, 8]]
    responses = [[4], [6, 7, 8, 9, 10, 11, 12, 13, 14], [6, 7], [12, 13, 14], [3]]
    weights = torch.tensor([0.5, -1.0, 2.0, 1.5, -0.25], dtype=torch.float64)

    def grads(run) -> dict[str, torch.Tensor]:
        net = copy.deepcopy(model64).train()
        run(net)
        return {n: p.grad.clone() for n, p in net.named_parameters()}

    def one_backward(net):
        logp, scored = response_logprobs(net, prompts, responses, 0, 1.0)
        (logp * scored * weights[:, None]).sum().backward()

    def chunk_loss(rows, logp, scored):
        return (logp * scored * weights[rows][:, None]).sum()

    want = grads(one_backward)
    got = grads(lambda net: backward_logprobs(net, prompts, responses, 0, 1.0, chunk_loss))
    padded = grads(lambda net: backward_logprobs(net, prompts, responses, 0, 1.0, chunk_loss,
                                                 pad_passes=2))
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-10, atol=1e-12)
        assert torch.equal(padded[name], got[name]), name


def backward_nodes(root: torch.Tensor) -> list:
    """Every node of ``root``'s autograd graph, once."""
    seen, stack, nodes = set(), [root.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        nodes.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return nodes


def sums_repeated_rows(node) -> bool:
    """An indexing backward whose index repeats a row: it sums those rows' gradients by an
    accumulating ``index_put_`` (a permutation's backward sums nothing)."""
    return type(node).__name__ == "IndexBackward0" and any(
        index is not None and len(index.unique()) < index.numel()
        for index in node._saved_indices)


def test_the_gradients_repeat_bit_for_bit_on_two_threads(model):
    """Rows continue their prompt's KV by ``index_select``: indexing's backward (an
    accumulating ``index_put_``) sums the rows of a prompt in no fixed order on several CPU
    threads, so a seeded run's weights differed by an ulp after its first update (measured:
    24 of 38 tensors) and its curves drifted apart; the same update now repeats exactly.
    Whether two runs race apart depends on the cores free, so the graph is checked too: the
    rows reach their prompt's logits and KV through ``index_select``'s backward (a sum in
    row order), and through no indexing backward that sums rows."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 40, (24,), generator=gen).tolist() for _ in range(16)] * 8
    responses = [torch.randint(3, 40, (12,), generator=gen).tolist() for _ in prompts]

    def grads() -> dict[str, torch.Tensor]:
        net = copy.deepcopy(model).train()
        backward_logprobs(net, prompts, responses, 0, 1.0,
                          lambda rows, logp, scored: (logp * scored).sum())
        return {n: p.grad.clone() for n, p in net.named_parameters()}

    nodes = backward_nodes(response_logprobs(model, prompts, responses, 0, 1.0)[0])
    assert "IndexSelectBackward0" in {type(node).__name__ for node in nodes}
    assert not [node for node in nodes if sums_repeated_rows(node)]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        first, second = grads(), grads()
    finally:
        torch.set_num_threads(threads)
    for name, grad in first.items():
        assert torch.equal(second[name], grad), name


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_loss_takes_no_step(model, tokenizer, batch, bad):
    """An advantage of NaN or inf makes the loss and gradient non-finite: the weights and the
    optimizer state stay bit for bit, and the metrics say so."""
    policy = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    advantages = [bad, *ADVANTAGES[1:]]
    broken = batch.set_column(batch.schema.get_field_index("advantage"),
                              TRAINABLE.field("advantage"), pa.array(advantages, pa.float32()))
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    metrics = update_policy(policy, optimizer, broken, UpdateParams(epochs=2),
                            tokenizer.pad_token_id)
    assert metrics["nonfinite_update"] == 1.0
    assert not (math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]))
    for name, tensor in policy.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    assert not optimizer.state  # no step was taken
    assert all(p.grad is None for p in policy.parameters())
    assert update_policy(policy, optimizer, batch, UpdateParams(),
                         tokenizer.pad_token_id)["nonfinite_update"] == 0.0


def with_turns(table: pa.Table, per_turn: list[list[float]] | None) -> pa.Table:
    """``table`` as two-turn episodes: each response's middle third an observation (loss mask
    0), the rest two generated turns; ``per_turn`` each row's ``turn_advantage``, if given."""
    masks = []
    for r in table.column("response_ids").to_pylist():
        a, b = len(r) // 3 or 1, 2 * len(r) // 3 or 1
        masks.append([1] * a + [0] * (b - a) + [1] * (len(r) - b))
    table = table.append_column("loss_mask", pa.array(masks, pa.list_(pa.int8())))
    if per_turn is not None:
        table = table.append_column("turn_advantage", pa.array(per_turn, pa.list_(pa.float32())))
    return table


def test_turn_advantages_weigh_each_turns_tokens(model64, tokenizer, batch):
    """The same advantage on both turns is the sequence advantage, bit for bit; and the
    gradient is linear in the turns' advantages: [A, B] = [A, 0] + [0, B] (at ratio 1 no
    clip acts), up to float32 rounding of each tensor's scale, as micro-batching is."""
    pad = tokenizer.pad_token_id
    rows = [r for r in range(batch.num_rows) if len(batch.column("response_ids")[r]) >= 3]
    batch = batch.take(rows)  # two generated turns each
    adv = batch.column("advantage").to_pylist()
    second = [-a / 2 for a in adv]
    sequence, _ = grads_after_one_step(model64, with_turns(batch, None), 64, pad)
    same, _ = grads_after_one_step(model64, with_turns(batch, [[a, a] for a in adv]), 64, pad)
    for name in sequence:
        assert torch.equal(same[name], sequence[name]), name
    both, _ = grads_after_one_step(model64, with_turns(batch, [[a, b] for a, b in
                                                               zip(adv, second)]), 64, pad)
    first, _ = grads_after_one_step(model64, with_turns(batch, [[a, 0] for a in adv]), 64, pad)
    later, _ = grads_after_one_step(model64, with_turns(batch, [[0, b] for b in second]), 64,
                                    pad)
    for name in both:
        scale = float(both[name].abs().max())
        torch.testing.assert_close(first[name] + later[name], both[name], rtol=1e-5,
                                   atol=1e-6 * scale)
        if scale > 0:
            assert not torch.equal(both[name], sequence[name]), name


def test_turn_advantages_must_match_the_turns(model64, tokenizer, batch):
    table = with_turns(batch, [[1.0]] * batch.num_rows)
    with pytest.raises(ValueError, match="2 generated turns but 1 turn advantages"):
        grads_after_one_step(model64, table, 64, tokenizer.pad_token_id)
