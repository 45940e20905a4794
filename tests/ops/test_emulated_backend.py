"""Emulated generation and update tasks: lengths from the trace, times from the profile."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pytest

from rlhfless.ops import emulated_backend as emu
from rlhfless.ops.gen_stats import Generated
from rlhfless.ops.schema import ROLLOUTS
from rlhfless.schedulers.profiles import get_profile
from rlhfless.schedulers.sim_engine import simulate_run

PROFILE = get_profile("Qwen2.5-3B@L40S")
SCALE = 0.01  # an emulated second lasts 10 ms
N = 4


def _shard(lengths: list[list[int]], prompt_len: int = 30) -> pa.Table:
    return pa.table({
        "prompt_id": [f"p{i}" for i in range(len(lengths))],
        "prompt_ids": pa.array([[7 + i] * prompt_len for i in range(len(lengths))],
                               pa.list_(pa.int32())),
        "answer": ["0"] * len(lengths), "data_source": ["emulated"] * len(lengths),
        emu.LENGTHS: pa.array(lengths, pa.list_(pa.int64())),
    })


def _spec(cap: int = 1024) -> emu.EmulatedGenSpec:
    return emu.EmulatedGenSpec(PROFILE, N, SCALE, cap, max_new_tokens=512)


@pytest.fixture(autouse=True)
def fresh_worker_state():
    emu._STATE["version"] = 0
    emu._PAUSED.clear()


def _expected(lengths: list[list[int]], prompt_len: int = 30, t0: float = 0.0):
    flat = np.asarray(lengths).ravel()
    prefill = np.zeros(flat.size)
    prefill[::N] = prompt_len
    return simulate_run(t0, np.arange(flat.size), flat, np.full(flat.size, prompt_len), prefill,
                        PROFILE, 1024)


def test_generate_takes_the_profiles_time_and_the_traces_lengths():
    lengths = [[40, 80, 120, 500], [10, 20, 30, 40]]
    started = time.time()
    out = emu.generate_task(_shard(lengths), emu.EmulatedWeights(1), _spec(), seed=0)
    wall = time.time() - started
    expected = _expected(lengths, t0=PROFILE.sync_s)  # version 1 is fetched first
    table = out.table
    assert out.stats.gen_seconds == pytest.approx(expected.t_finish)
    assert out.stats.decode_steps == expected.n_steps and out.stats.late_wall_s >= 0
    assert expected.t_finish * SCALE <= wall <= expected.t_finish * SCALE + 0.5
    assert table.schema.equals(ROLLOUTS)
    assert [len(r) for r in table.column("response_ids").to_pylist()] == sum(lengths, [])
    assert table.column("sample_idx").to_pylist() == [0, 1, 2, 3] * 2
    assert table.column("policy_version").to_pylist() == [1] * 8
    assert table.column("response_text").to_pylist() == [str(x % 2) for x in sum(lengths, [])]


def test_chunk_then_resume_is_the_whole_schedule():
    lengths = [[40, 80, 120, 500], [10, 20, 30, 50]]
    weights, spec = emu.EmulatedWeights(0), _spec()
    out = emu.generate_chunk_task(_shard(lengths), weights, spec, 0, 0.5, key="k")
    done = out["done"].table
    assert len(done) == 4 and len(out["cut"]) == 4
    assert sorted(len(r) for r in done.column("response_ids").to_pylist()) == [10, 20, 30, 40]
    rest = emu.resume_task("k", weights, spec)
    whole = _expected(lengths)
    both = out["done"].stats.merge(rest.stats)
    assert both.gen_seconds == pytest.approx(whole.t_finish)
    assert both.decode_tokens == int(whole.batch.sum())
    got = pa.concat_tables([done, rest.table])
    assert sorted(zip(got.column("prompt_id").to_pylist(), got.column("sample_idx").to_pylist(),
                      (len(r) for r in got.column("response_ids").to_pylist()))) == sorted(
        (f"p{g}", s, lengths[g][s]) for g in range(2) for s in range(N))
    assert not emu.drop_task("k")  # resumed: nothing paused is left


def test_a_moved_tail_recomputes_its_prefix_and_finishes_elsewhere():
    lengths = [[40, 80, 120, 500]]
    weights, spec = emu.EmulatedWeights(0), _spec()
    out = emu.generate_chunk_task(_shard(lengths), weights, spec, 0, 0.5, key="k")
    cut = out["cut"]
    partial = [len(p) for p in cut.column("partial_ids").to_pylist()]
    assert partial == [80, 80]  # cut when the second of four finished
    assert emu.drop_task("k")
    moved = emu.continue_task(cut, weights, spec, seed=1)
    expected = simulate_run(0.0, np.arange(2), np.array([40, 420]), np.array([110, 110]),
                            np.array([110.0, 110.0]), PROFILE, 1024)
    assert moved.stats.gen_seconds == pytest.approx(expected.t_finish)
    assert moved.stats.prefill_tokens == 220  # prompt + generated, recomputed
    assert [len(r) for r in moved.table.column("response_ids").to_pylist()] == [120, 500]


def test_the_update_takes_the_learners_time():
    rows = pa.table({"prompt_ids": pa.array([[1] * 100] * 8, pa.list_(pa.int32())),
                     "response_ids": pa.array([[0] * 300] * 8, pa.list_(pa.int32())),
                     "reward": pa.array([1.0, 0.0] * 4)})
    spec = emu.EmulatedTrainSpec(PROFILE, train_gpus=16, time_scale=SCALE)
    metrics = emu.update_task([Generated(rows)], emu.EmulatedWeights(0), spec)
    tokens = 8 * 400
    assert metrics["update_seconds"] == pytest.approx(
        PROFILE.forward_seconds(tokens, 16) + PROFILE.update_seconds(tokens, 16))
    assert metrics["reward_mean"] == 0.5
    assert emu.publish_task(metrics, spec, 3) == emu.EmulatedWeights(3)


def test_the_emulated_tasks_do_not_import_torch():
    code = ("import sys; import rlhfless.ops.emulated_backend; "
            "sys.exit('torch' in sys.modules or 'transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
