"""Assignment: exact partition, contiguous length runs, token balance, round-robin baseline,
groups whose episodes wait long spread."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfless.schedulers.assignment import (
    assign_by_length,
    assign_round_robin,
    balanced_starts,
    group_work,
    length_order,
)

lengths_st = st.lists(st.floats(0, 5000, allow_nan=False), min_size=0, max_size=200)


@settings(max_examples=200, deadline=None)
@given(pred=lengths_st, n_workers=st.integers(1, 50))
def test_every_group_lands_on_exactly_one_worker(pred, n_workers):
    runs = assign_by_length(np.array(pred), n_workers)
    assert len(runs) == n_workers
    flat = np.concatenate(runs)
    assert sorted(flat.tolist()) == list(range(len(pred)))
    assert sum(r.size > 0 for r in runs) == min(n_workers, len(pred))


@settings(max_examples=200, deadline=None)
@given(pred=lengths_st.filter(len), n_workers=st.integers(1, 50))
def test_runs_are_contiguous_in_the_ranking_and_balanced(pred, n_workers):
    pred = np.array(pred)
    runs = [r for r in assign_by_length(pred, n_workers) if r.size]
    ranking = length_order(pred)
    assert np.array_equal(np.concatenate(runs), ranking)  # worker 0 longest, no interleaving
    share = pred.sum() / len(runs)
    for r in runs:
        assert pred[r].sum() <= share + pred.max() + 1e-6


@settings(max_examples=200, deadline=None)
@given(n_groups=st.integers(0, 300), n_workers=st.integers(1, 40))
def test_round_robin_partitions_too(n_groups, n_workers):
    runs = assign_round_robin(n_groups, n_workers)
    assert sorted(np.concatenate(runs).tolist()) == list(range(n_groups))


def test_short_groups_go_many_to_a_worker_long_ones_few():
    pred = np.array([1000, 1000, 100, 100, 100, 100, 100, 100, 100, 100, 100, 100,
                     100, 100, 100, 100, 100, 100, 100, 100, 100, 100], dtype=float)
    runs = assign_by_length(pred, 2)  # 4000 tokens in all: 2000 each
    assert runs[0].tolist() == [0, 1]
    assert runs[1].tolist() == list(range(2, 22))


def test_equal_lengths_split_evenly_and_ties_keep_input_order():
    runs = assign_by_length(np.full(12, 50.0), 4)
    assert [r.tolist() for r in runs] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


def test_zero_predictions_balance_counts():
    assert [r.size for r in assign_by_length(np.zeros(9), 3)] == [3, 3, 3]


def test_groups_whose_episodes_wait_long_are_spread_across_workers():
    pred = np.array([100.0, 90.0, 80.0, 10.0])
    # by length, groups 1 and 2 share worker 1 (270 tokens, nearest split 100 | 180)
    assert [r.tolist() for r in assign_by_length(pred, 2)] == [[0], [1, 2, 3]]
    work = group_work(pred, np.array([0.0, 30.0, 30.0, 0.0]), step_seconds=0.02)
    np.testing.assert_allclose(work, [2.0, 31.8, 31.6, 0.2])  # seconds per sample
    assert [r.tolist() for r in assign_by_length(work, 2)] == [[1], [2, 0, 3]]


@settings(max_examples=100, deadline=None)
@given(pred=lengths_st, step_seconds=st.floats(0, 1), n_workers=st.integers(1, 20))
def test_without_time_outside_the_model_the_work_is_the_lengths(pred, step_seconds, n_workers):
    pred = np.array(pred)
    for env in (None, np.zeros(pred.size)):
        work = group_work(pred, env, step_seconds)
        assert np.array_equal(work, pred)
        assert [r.tolist() for r in assign_by_length(work, n_workers)] == [
            r.tolist() for r in assign_by_length(pred, n_workers)]


def test_round_robin_by_hand():
    assert [r.tolist() for r in assign_round_robin(7, 3)] == [[0, 3, 6], [1, 4], [2, 5]]


@settings(max_examples=100, deadline=None)
@given(pred=st.lists(st.floats(0, 5000, allow_nan=False), min_size=1, max_size=80))
def test_many_candidates_at_once_equal_one_at_a_time(pred):
    pred = np.array(pred)
    prefix = np.concatenate([[0.0], np.cumsum(pred[length_order(pred)])])
    ns = np.arange(1, pred.size + 1)
    together = np.split(balanced_starts(prefix, ns), np.cumsum(ns)[:-1])
    for n, starts in zip(ns, together, strict=True):
        assert np.array_equal(starts, balanced_starts(prefix, np.array([n])))
        assert starts[0] == 0 and np.all(np.diff(starts) > 0) and starts[-1] < pred.size


def test_bad_inputs_say_what_is_allowed():
    with pytest.raises(ValueError, match="n_workers=0"):
        assign_by_length(np.ones(3), 0)
    with pytest.raises(ValueError, match=r"pred_lengths\[1\]"):
        assign_by_length(np.array([1.0, -2.0]), 2)
    with pytest.raises(ValueError, match="expected \\[n_groups\\]"):
        assign_by_length(np.ones((2, 2)), 2)
    with pytest.raises(ValueError, match=r"pred_env_seconds\[0\]"):
        group_work(np.ones(2), np.array([-1.0, 0.0]), 0.1)
    with pytest.raises(ValueError, match="one per group"):
        group_work(np.ones(2), np.ones(3), 0.1)
    with pytest.raises(ValueError, match="1 <= n_workers <= n_groups"):
        balanced_starts(np.array([0.0, 1.0]), np.array([2]))
