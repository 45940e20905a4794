"""Tests of sharding: every prompt row goes to exactly one shard, prefix groups stay
together, token totals come out about even, and bad assignments are refused."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfless.ops.data.prefix_dedup import plan_prefixes
from rlhfless.ops.data.shard import split_balanced, take_shards

prompt_lengths = st.lists(st.integers(min_value=1, max_value=40), max_size=30)


@pytest.fixture(scope="module")
def table_of_lengths(ids_prompts):
    """``table_of_lengths([3, 5])``: PROMPTS rows p0, p1 of 3 and 5 tokens."""
    return lambda lengths: ids_prompts([[7] * n for n in lengths])


def ids_of(shards: list[pa.Table]) -> list[str]:
    return [p for s in shards for p in s.column("prompt_id").to_pylist()]


@settings(max_examples=150, deadline=None)
@given(lengths=prompt_lengths, n_shards=st.integers(min_value=1, max_value=40))
def test_split_covers_every_row_once(table_of_lengths, lengths, n_shards):
    table = table_of_lengths(lengths)
    shards = split_balanced(table, n_shards)
    assert len(shards) == n_shards
    # contiguous runs in order: concatenated, the shards are the table
    assert ids_of(shards) == table.column("prompt_id").to_pylist()
    for shard in shards:
        assert shard.schema == table.schema


@settings(max_examples=150, deadline=None)
@given(lengths=prompt_lengths.filter(bool), n_shards=st.integers(min_value=1, max_value=8))
def test_split_balances_tokens(table_of_lengths, lengths, n_shards):
    """A shard overshoots its even share of tokens by less than one prompt."""
    shards = split_balanced(table_of_lengths(lengths), n_shards)
    share = sum(lengths) / n_shards
    for shard in shards:
        tokens = sum(len(p) for p in shard.column("prompt_ids").to_pylist())
        assert tokens < share + max(lengths)


def test_split_of_equal_prompts_is_even(table_of_lengths):
    shards = split_balanced(table_of_lengths([10] * 12), 4)
    assert [s.num_rows for s in shards] == [3, 3, 3, 3]


def test_more_shards_than_rows_leaves_some_empty(table_of_lengths):
    table = table_of_lengths([5, 9])
    shards = split_balanced(table, 5)
    assert len(shards) == 5
    assert sorted(s.num_rows for s in shards) == [0, 0, 0, 1, 1]
    assert ids_of(shards) == ["p0", "p1"]


def test_empty_batch_gives_empty_shards(table_of_lengths):
    shards = split_balanced(table_of_lengths([]), 3)
    assert [s.num_rows for s in shards] == [0, 0, 0]


@settings(max_examples=100, deadline=None)
@given(
    prefixes=st.lists(st.sampled_from([(1, 2, 3, 4), (5, 6, 7, 8), (9,)]), max_size=20),
    n_shards=st.integers(min_value=1, max_value=6),
)
def test_prefix_groups_stay_adjacent(ids_prompts, prefixes, n_shards):
    ids = [[*p, 100 + i, 200 + i] for i, p in enumerate(prefixes)]  # interleaved groups
    plan = plan_prefixes(ids_prompts(ids), n_samples=2)
    shards = split_balanced(plan.prompts, n_shards)
    assert len(shards) == n_shards
    assert sorted(ids_of(shards)) == sorted(plan.prompts.column("prompt_id").to_pylist())
    groups = [g for s in shards for g in s.column("prefix_group").to_pylist()]
    assert groups == sorted(groups)  # each group one run, across and within shards
    for shard in shards:  # within a group, the batch's order is kept
        order = [int(p[1:]) for p in shard.column("prompt_id").to_pylist()]
        group = shard.column("prefix_group").to_pylist()
        for g in set(group):
            members = [o for o, h in zip(order, group) if h == g]
            assert members == sorted(members)


def test_split_rejects_no_shards(table_of_lengths):
    with pytest.raises(ValueError, match="n_shards must be >= 1"):
        split_balanced(table_of_lengths([3]), 0)


def test_take_shards_applies_an_assignment(table_of_lengths):
    table = table_of_lengths([1, 2, 3, 4, 5])
    shards = take_shards(table, [[4, 0], [], [2, 1, 3]])
    assert [s.column("prompt_id").to_pylist() for s in shards] == [
        ["p4", "p0"], [], ["p2", "p1", "p3"]
    ]  # one shard per index list, empty ones included, so shard i is worker i's


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        ([[0, 1], [1, 2]], r"rows \[1\] assigned \[2\] times"),  # duplicate
        ([[0], [2]], r"rows \[1\] assigned \[0\] times"),  # missing
        ([[0, 1, 2, 3]], "index out of range 0..2"),
        ([[0, 1, -1, 2]], "index out of range 0..2"),
    ],
)
def test_take_shards_rejects_bad_assignments(table_of_lengths, assignment, message):
    with pytest.raises(ValueError, match=message):
        take_shards(table_of_lengths([1, 2, 3]), assignment)
