"""``rlhfless graph``: every stage has its colour, and each generation shard is its own
labelled branch (checked on the graphviz source, not on pixels)."""

from __future__ import annotations

import re
import shutil

import pytest

from rlhfless.pipeline.config import Config
from rlhfless.pipeline.task_keys import ITERATION_STAGES as STAGES
from rlhfless.pipeline.task_keys import STAGE_COLOURS
from rlhfless.pipeline.train.render import render_graph


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz 'dot' is not installed")
def test_stages_are_coloured_and_shards_are_visible(tmp_path):
    dot = (tmp_path / "g.dot")
    render_graph(Config(gen_workers=3), str(dot))
    source = dot.read_text()
    for stage in STAGES:
        assert STAGE_COLOURS[stage] in source, stage
    per_shard = ("generate", "reward", "advantage")
    for stage in per_shard:
        assert sorted(re.findall(rf'label="?{stage}-1-(\d)', source)) == ["0", "1", "2"], stage
    assert sorted(re.findall(r'label="?shard (\d)', source)) == ["0", "1", "2"]
