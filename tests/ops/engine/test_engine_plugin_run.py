"""A new engine is one file and one registry line: the toy engine (``toy_engine.py``),
registered here as a user would, trains one iteration through ``train(cfg)`` on a real
LocalCluster with no other change; its workers build it from the spec's target."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from rlhfless.ops.engine.registry import register_engine
from rlhfless.pipeline.config import Config, ConfigError
from rlhfless.pipeline.train.loop import train


def test_a_registered_engine_trains_through_the_one_driver(tiny_model_dir, tmp_path):
    register_engine("toy", "toy_engine:ToyEngine")
    cfg = Config(model=str(tiny_model_dir), runs_dir=str(tmp_path), backend="toy",
                 iterations=1, batch_prompts=4, n_samples=2, max_new_tokens=6,
                 heldout_prompts=4, eval_every=1, gen_workers=1, train_threads=1,
                 policy="static", checkpoint_every=100)
    run = train(cfg, progress=False, log=lambda *_: None)
    rows = pq.read_table(run.path / "rollouts" / "iter-00001.parquet")
    assert rows.num_rows == 8
    assert set(rows.column("worker").to_pylist()) == {"gen-0"}  # generated on a worker
    iteration = next(m for m in run.metrics() if m.get("event") == "iteration")
    assert iteration["tokens"] > 0 and "loss" in iteration


def test_an_unknown_engine_or_dtype_is_one_line():
    with pytest.raises(ConfigError, match="backend 'tgi': choose one of hf, vllm"):
        Config(backend="tgi")
    with pytest.raises(ConfigError, match="gen_dtype = 'float64': backend 'vllm' loads one of"):
        Config(backend="vllm", gen_dtype="float64")
    assert Config(backend="hf", gen_dtype="float64").gen_dtype == "float64"  # hf's own list
