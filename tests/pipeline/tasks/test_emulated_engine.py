"""The emulated engine and trainer: lengths from the trace, times from the profile, through
the engine protocol (the same calls the generation tasks make)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

import pyarrow as pa
import pytest

from rlhfless.ops.algo.update import UpdateParams
from rlhfless.ops.data.schema import ROLLOUTS
from rlhfless.ops.engine.engine_types import EngineSpec, SamplingParams, StopRule, WeightsRef
from rlhfless.ops.engine.gen_stats import Generated, GenerationStats
from rlhfless.ops.engine.registry import make_engine, resolved
from rlhfless.pipeline.tasks import emulated as emu
from rlhfless.pipeline.tasks.trainer import TrainSpec
from rlhfless.schedulers.profiles import get_profile

# round numbers, so that every expected time below is worked out by hand: a decode step takes
# 0.02 s + 0.001 s per live sequence + 1e-6 s per context token; prefill 600 tokens/s
PROFILE = dataclasses.replace(
    get_profile("Qwen2.5-3B@L40S"), step_base_s=0.02, step_per_seq_s=0.001,
    step_per_ctx_token_s=1e-6, prefill_tokens_per_s=600.0, sync_s=0.25, update_overhead_s=1.0,
    update_tokens_per_s_per_gpu=100.0, forward_tokens_per_s_per_gpu=400.0,
    learner_forward_passes=2)
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


PARAMS = SamplingParams(max_new_tokens=512)


def _engine(version: int = 0) -> emu.EmulatedEngine:
    """The engine a worker builds from the run's spec (options by name), on ``PROFILE``."""
    spec = resolved(EngineSpec("emulated", backend="emulated",
                               options={"time_scale": SCALE, "cap": 1024}))
    engine = make_engine(spec)
    engine.profile = PROFILE
    engine.load()
    if version:
        engine.set_weights(WeightsRef(version, emu.WEIGHTS_PATH))
    return engine


def _decode_s(lengths: list[int], ctx0: int) -> float:
    """Hand-worked decode seconds when all sequences start together (the cap is far above
    them): as many steps as the longest, each live sequence costs its step's per-sequence
    part, and sequence i holds ctx0 + s context tokens at its step s (sum: l·ctx0 + l(l-1)/2)."""
    return (0.02 * max(lengths) + 0.001 * sum(lengths)
            + 1e-6 * sum(n * ctx0 + n * (n - 1) / 2 for n in lengths))


def test_generate_takes_the_profiles_time_and_the_traces_lengths():
    lengths = [[40, 80, 120, 500], [10, 20, 30, 40]]
    started = time.time()
    table, stats = _engine(version=1).generate(_shard(lengths), N, PARAMS)
    wall = time.time() - started
    # version 1 is fetched first (0.25 s), each group's 30-token prompt prefilled once
    # (60 / 600 s), 500 decode steps: 10 + 0.84 + 0.16248 s
    assert _decode_s(sum(lengths, []), 30) == pytest.approx(11.00248)
    assert stats.gen_seconds == pytest.approx(0.25 + 0.1 + 11.00248)
    assert stats.decode_steps == 500 and stats.decode_tokens == 840
    # 8 requests; each group's 30-token prompt prefilled once, reused by its 3 other samples
    assert stats.prefill_requests == 8 and stats.prefill_reused_tokens == 2 * 3 * 30
    # it slept for its emulated time, and the time it ran past that is what it reports late
    late = stats.late_wall_s
    assert late >= 0 and stats.gen_seconds * SCALE + late <= wall
    assert table.schema.equals(ROLLOUTS)
    assert [len(r) for r in table.column("response_ids").to_pylist()] == sum(lengths, [])
    assert table.column("sample_idx").to_pylist() == [0, 1, 2, 3] * 2
    assert table.column("policy_version").to_pylist() == [1] * 8
    assert table.column("response_text").to_pylist() == [str(x % 2) for x in sum(lengths, [])]


def test_chunk_then_resume_is_the_whole_schedule():
    lengths = [[40, 80, 120, 500], [10, 20, 30, 50]]
    engine = _engine()
    chunk = engine.generate_until(_shard(lengths), N, PARAMS, StopRule(0.5))
    done = chunk.done
    assert len(done) == 4 and len(chunk.cut) == 4
    assert sorted(len(r) for r in done.column("response_ids").to_pylist()) == [10, 20, 30, 40]
    rest_table, rest_stats = engine.resume(chunk.paused, PARAMS)
    both = chunk.stats.merge(rest_stats)
    # the whole schedule: no fetch (version 0 is held), two prompts of 30 tokens prefilled
    assert both.gen_seconds == pytest.approx(60 / 600 + _decode_s(sum(lengths, []), 30))
    assert both.decode_tokens == 850 and both.decode_steps == 500
    got = pa.concat_tables([done, rest_table])
    assert sorted(zip(got.column("prompt_id").to_pylist(), got.column("sample_idx").to_pylist(),
                      (len(r) for r in got.column("response_ids").to_pylist()))) == sorted(
        (f"p{g}", s, lengths[g][s]) for g in range(2) for s in range(N))


def test_a_moved_tail_recomputes_its_prefix_and_finishes_elsewhere():
    lengths = [[40, 80, 120, 500]]
    chunk = _engine().generate_until(_shard(lengths), N, PARAMS, StopRule(0.5))
    cut = chunk.cut
    partial = [len(p) for p in cut.column("partial_ids").to_pylist()]
    assert partial == [80, 80]  # cut when the second of four finished
    table, stats = _engine().continue_rows(cut, PARAMS)  # on another worker's engine
    # 40 and 420 tokens left, each prefilling its 30 + 80 tokens again: 220 / 600 s + 420 steps
    assert stats.gen_seconds == pytest.approx(220 / 600 + _decode_s([40, 420], 110))
    assert _decode_s([40, 420], 110) == pytest.approx(8.4 + 0.46 + 0.13937)
    assert stats.prefill_tokens == 220  # prompt + generated, recomputed
    assert [len(r) for r in table.column("response_ids").to_pylist()] == [120, 500]


def test_the_update_takes_the_learners_time():
    rows = pa.table({"prompt_ids": pa.array([[1] * 100] * 8, pa.list_(pa.int32())),
                     "response_ids": pa.array([[0] * 300] * 8, pa.list_(pa.int32())),
                     "reward": pa.array([1.0, 0.0] * 4)})
    trainer = emu.EmulatedTrainer(emu.EmulatedLearner(PROFILE.name, 16, SCALE))
    trainer.profile = PROFILE
    spec = TrainSpec(EngineSpec("emulated"), UpdateParams(lr=0.25), None,
                     emulate=trainer.learner)
    metrics = trainer.update([Generated(rows)], spec)
    # 3200 tokens on 16 GPUs: two forwards at 400 tokens/s/GPU (1 s), 1 s + 3200 / 1600 s update
    assert metrics["update_seconds"] == pytest.approx(1.0 + 3.0)
    assert metrics["update_tokens"] == 8 * 400 and metrics["lr"] == 0.25
    assert trainer.publish(spec, 3) == WeightsRef(3, emu.WEIGHTS_PATH) and trainer.version == 3


def test_an_emulated_worker_imports_no_torch():
    """What an emulated generation worker preloads (pools.gen_tasks: the tail tasks too, as
    the engine exports its tails) loads no framework."""
    code = ("import sys; import rlhfless.pipeline.tasks.emulated, rlhfless.pipeline.tasks.rollout,"
            " rlhfless.pipeline.tasks.tail; "
            "sys.exit('torch' in sys.modules or 'transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_pause_stops_the_chunk_at_the_end_of_the_step_it_is_in():
    """The stop rule's pause, looked at as the chunk sleeps, cuts at a step boundary before
    tau would; every unfinished sequence holds as many tokens as steps ran (all were
    admitted at the first), and the rest resumed makes the whole schedule."""
    lengths = [[40, 80, 120, 500], [10, 20, 30, 50]]
    engine = _engine()
    chunk = engine.generate_until(_shard(lengths), N, PARAMS, StopRule(0.5, lambda: True))
    steps = chunk.stats.decode_steps
    assert 1 <= steps < 40  # tau would have cut at 40 steps (the fourth of eight done)
    partial = [len(p) for p in chunk.cut.column("partial_ids").to_pylist()]
    assert partial == [steps] * len(chunk.cut)
    assert len(chunk.done) == sum(n <= steps for n in sum(lengths, []))
    rest_table, rest_stats = engine.resume(chunk.paused, PARAMS)
    both = chunk.stats.merge(rest_stats)
    assert both.gen_seconds == pytest.approx(60 / 600 + _decode_s(sum(lengths, []), 30))
    assert len(chunk.done) + len(rest_table) == 8


def _wide_decode_s(profile, remaining: list[int], ctx: list[int]) -> float:
    """Hand-worked decode seconds of sequences all live from the first step (the cap far
    above them) on ``profile``: sequence i adds its per-sequence part and ctx_i + s context
    tokens at its step s."""
    return (profile.step_base_s * max(remaining) + profile.step_per_seq_s * sum(remaining)
            + profile.step_per_ctx_token_s * sum(n * c + n * (n - 1) / 2
                                                 for n, c in zip(remaining, ctx)))


def test_tails_consolidated_on_an_engine_widened_to_tp2_take_its_time():
    """PAT's reconfiguration on the emulated engine: one worker's tail exported, adopted
    with the target's own, the target widened to TP 2: the fixed reconfiguration cost, the
    KV transfer at the TP-1 worker's link, then decoding on the profile re-derived at TP 2."""
    from rlhfless.schedulers.pat import RECONFIG_FIXED_S
    from rlhfless.schedulers.profiles import LINK_EFFICIENCY

    real = get_profile("Qwen2.5-3B@L40S")
    engines = [_engine(), _engine()]
    for e in engines:
        e.base = e.profile = real
    chunks = [e.generate_until(_shard([[40, 80, 120, 500]]), N, PARAMS, StopRule(0.5))
              for e in engines]
    source, target = engines
    moved = dataclasses.replace(source.export_paused(chunks[0].paused), pid=-1)  # elsewhere
    own = target.export_paused(chunks[1].paused)
    assert moved.context_tokens == own.context_tokens == 2 * (30 + 80)
    stats = GenerationStats()
    adopted = target.adopt([own, moved], None, PARAMS, stats)
    link = real.hardware.gpu_link_gbs * 1e9 * LINK_EFFICIENCY  # one TP-1 worker's GPU
    transfer = 220 * real.kv_bytes_per_token / link  # the remote tail's bytes; own stay
    assert stats.kv_load_seconds == pytest.approx(transfer) and stats.prefill_tokens == 0
    assert target.widen(2) == 1 and target.profile.tp == 2
    table, wide = target.resume(adopted, PARAMS)
    tp2 = real.variant(tp=2)
    assert tp2.step_base_s < real.step_base_s  # each GPU reads half the weights
    expected = RECONFIG_FIXED_S + transfer + _wide_decode_s(tp2, [40, 420] * 2, [110] * 4)
    assert wide.gen_seconds == pytest.approx(expected)
    assert sorted(len(r) for r in table.column("response_ids").to_pylist()) == [
        120, 120, 500, 500]
    assert target.widen(1) == 2 and target.profile is real
    assert target._t0() == 0.0  # nothing left to charge once narrowed
