"""Tests of prefix dedup: groups, prefix lengths and prefill counts worked out by hand."""

from __future__ import annotations

import pytest

from rlhfless.ops.data.prefix_dedup import plan_prefixes


def planned(ids_prompts, ids: list[list[int]], n_samples: int = 1, min_prefix: int = 4):
    plan = plan_prefixes(ids_prompts(ids), n_samples, min_prefix=min_prefix)
    groups = plan.prompts.column("prefix_group").to_pylist()
    lens = plan.prompts.column("prefix_len").to_pylist()
    return plan, groups, lens


def test_template_prefix_is_shared_and_a_lone_prompt_is_not(ids_prompts):
    ids = [
        [1, 2, 3, 4, 5, 6],  # a   the three share the "template" 1 2 3 4
        [7, 7],  # d                no shared prefix
        [1, 2, 3, 4, 5, 7, 8],  # b
        [1, 2, 3, 4, 9],  # c
    ]
    plan, groups, lens = planned(ids_prompts, ids, n_samples=3)
    # sorted: a, b, c, d. a-b share 5 tokens, b-c 4 (chain prefix 4), c-d 0
    assert groups == [0, 1, 0, 0]
    assert lens == [4, 0, 4, 4]
    # without sharing every (prompt, sample) prefills in full: 3 * (6 + 2 + 7 + 5)
    assert plan.naive_prefill_tokens == 60
    # with the plan: the prefix 1 2 3 4 once, then the suffixes 2 + 2 + 3 + 1
    assert plan.planned_prefill_tokens == 4 + 8
    assert plan.saved_prefill_tokens == 48


def test_input_columns_and_order_are_kept(ids_prompts):
    table = ids_prompts([[5, 6, 7], [1, 2, 3]], answers=["x", "y"])
    plan = plan_prefixes(table, 2)
    assert plan.prompts.column_names == table.column_names + ["prefix_group", "prefix_len"]
    assert plan.prompts.select(table.column_names).equals(table)


def test_min_prefix_threshold(ids_prompts):
    ids = [[1, 2, 3, 8, 8], [1, 2, 3, 9, 9]]  # common prefix of 3 tokens
    plan, groups, lens = planned(ids_prompts, ids, min_prefix=4)
    assert groups == [0, 1] and lens == [0, 0]
    assert plan.planned_prefill_tokens == plan.naive_prefill_tokens == 10

    plan, groups, lens = planned(ids_prompts, ids, min_prefix=3)
    assert groups == [0, 0] and lens == [3, 3]
    assert plan.planned_prefill_tokens == 3 + 2 + 2


def test_chain_breaks_where_the_common_prefix_falls_below_min_prefix(ids_prompts):
    ids = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [1, 2, 3, 9, 9]]
    plan, groups, lens = planned(ids_prompts, ids, n_samples=2)
    assert groups == [0, 0, 1]
    assert lens == [5, 5, 0]
    assert plan.naive_prefill_tokens == 2 * 17
    assert plan.planned_prefill_tokens == 5 + 1 + 1 + 5


def test_every_member_keeps_a_suffix_token(ids_prompts):
    # the first prompt is all prefix of the second: the group's prefix stops one token
    # short of it, so its last token's logits come out of the suffix prefill
    ids = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]]
    plan, groups, lens = planned(ids_prompts, ids)
    assert groups == [0, 0]
    assert lens == [4, 4]
    assert plan.planned_prefill_tokens == 4 + 1 + 2
    assert plan.naive_prefill_tokens == 11

    # identical prompts likewise share all but their last token
    plan, groups, lens = planned(ids_prompts, [[4, 4, 4, 4, 4]] * 3, n_samples=2)
    assert groups == [0, 0, 0] and lens == [4, 4, 4]
    assert plan.planned_prefill_tokens == 4 + 3 * 1
    assert plan.naive_prefill_tokens == 30


def test_groups_with_the_same_prefix_tokens_count_it_once(ids_prompts):
    # both groups end up with the prefix 1 2 3 (clipped so each member keeps a suffix
    # token); generation prefills a prefix once per distinct token sequence, so does the plan
    ids = [[1, 2, 3, 4], [1, 2, 3, 4, 5], [1, 2, 3, 5], [1, 2, 3, 5, 6]]
    plan, groups, lens = planned(ids_prompts, ids)
    assert groups == [0, 0, 1, 1]
    assert lens == [3, 3, 3, 3]
    assert plan.planned_prefill_tokens == 3 + 1 + 2 + 1 + 2


def test_single_prompt_and_n_samples(ids_prompts):
    plan, groups, lens = planned(ids_prompts, [[1, 2, 3, 4, 5]], n_samples=4)
    assert groups == [0] and lens == [0]
    assert plan.naive_prefill_tokens == 20
    assert plan.planned_prefill_tokens == 5  # the n samples share the whole prompt


def test_empty_batch(ids_prompts):
    plan = plan_prefixes(ids_prompts([]), 2)
    assert plan.prompts.num_rows == 0
    assert plan.naive_prefill_tokens == plan.planned_prefill_tokens == 0


def test_bad_input_raises(ids_prompts):
    with pytest.raises(ValueError, match="row 1 has no tokens"):
        plan_prefixes(ids_prompts([[1, 2], []]), 2)
    with pytest.raises(ValueError, match="n_samples must be >= 1"):
        plan_prefixes(ids_prompts([[1, 2]]), 0)
    with pytest.raises(ValueError, match="missing column 'prompt_ids'"):
        plan_prefixes(ids_prompts([[1, 2]]).drop_columns(["prompt_ids"]), 1)
