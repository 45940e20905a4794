"""One task-key grammar (``pipeline/task_keys.py``): keys built by ``task_key`` read back
to their parts, their stage as Dask's ``key_split`` groups them, and no iteration for a
tagged side graph or a key of Dask's own."""

from __future__ import annotations

import pytest
from dask.utils import key_split

from rlhfless.pipeline.task_keys import TaskKey, iteration_of, parse_key, stage_of, task_key


@pytest.mark.parametrize("parts", [("update", 7, None, None, ""), ("generate", 3, 1, None, ""),
                                   ("continue", 3, 1, 0, ""), ("generate", 2, 0, None, "eval"),
                                   ("chunk", 0, 1, None, "modes-kv")])
def test_keys_read_back_to_their_parts(parts):
    stage, iteration, shard, part, tag = parts
    key = task_key(stage, iteration, shard, part, tag=tag)
    assert parse_key(key) == TaskKey(*parts) and stage_of(key) == stage
    assert iteration_of(key) == (None if tag else iteration)
    if not tag:
        assert key_split(key) == stage  # the dashboard's grouping


def test_the_grammar_and_what_lies_outside_it():
    assert task_key("generate", 3, 1) == "generate-3-1"
    assert task_key("dedup", 4, tag="eval") == "eval-dedup-4"
    assert iteration_of(("shard-12", 0)) == 12  # a tuple key: its name
    for other in ("getitem-4f2a9c1e", "start_trainer_task-rank-0-x", "generate", "1-2"):
        assert parse_key(other) is None and iteration_of(other) is None
    for bad in (("gen3", 1, None, None), ("continue", 1, None, 2)):
        with pytest.raises(ValueError, match="task_key"):
            task_key(*bad)
