"""Emulated generation and update tasks: the time a GPU profile says, no tensor work.

``backend = "emulated"`` replaces the engine and the trainer's update by tasks that sleep for
what the simulator's GPU profile (``schedulers/profiles.py``) says the work would take, so
that a pool of many generation workers fits on one small machine (this module imports
neither torch nor transformers: a worker that runs only these tasks stays small). Everything
around them is the real runtime: Dask scheduler and worker processes, the elasticity plugin,
scaling, assignment, tail handling, the ledger, Arrow tables between stages.

What is emulated, and from where:

- response lengths: each prompt row carries ``emulated_lengths`` (its group's lengths, from a
  workload trace, ``schedulers/sim/workloads.py``); a response is that many tokens;
- a shard's decode: continuous batching under the profile's step model, by the simulator's
  own engine (``sim_engine.simulate_run``: decode step time by batch and context, prefill
  charged in the step that admits a sequence, the engine's batch cap); each group's prompt is
  prefilled once (prefix sharing);
- a chunk that pauses at completion fraction ``until_finished`` stops at the step boundary
  where that many sequences are done; ``resume_task`` runs the rest of the same schedule,
  ``continue_task`` reschedules cut sequences elsewhere, recomputing prompt + generated
  tokens as prefill;
- weight load: ``profile.sync_s`` when a task needs a newer version than the worker holds;
- cold start: ``profile.gen_cold_start_s`` from the worker process's start, slept in a Dask
  preload (``dask_setup``) before the worker registers, so the scheduler, the ledger and the
  policy see it as the worker's start-up;
- the update: the profile's forward-only passes plus ``update_seconds`` over prompt +
  response tokens on ``train_gpus`` learner GPUs.

An emulated second lasts ``time_scale`` wall seconds; every duration a task reports is in
emulated seconds. A task sleeps until its start plus its emulated duration times the scale,
so its own bookkeeping (building tables) is inside that duration when it is shorter.
Responses are ``length`` zero tokens with zero log-probabilities; ``response_text`` is the
length's parity (``"0"`` or ``"1"``), so a prompt whose ``answer`` is ``"0"`` scores 1 with the
``exact`` verifier for an even length: a deterministic reward from the trace.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.compute as pc
from distributed import get_worker

from rlhfless.ops.data.schema import ROLLOUTS
from rlhfless.ops.engine.gen_stats import Generated, GenerationStats
from rlhfless.schedulers.profiles import Profile
from rlhfless.schedulers.sim.engine import WorkerRun, simulate_run

LENGTHS = "emulated_lengths"  # prompt column: the trace's response lengths of its group
LENGTH = "emulated_length"  # the same, per (prompt, sample) row of a cut tail
COLD_START_ENV = "RLHFLESS_EMULATED_COLD_START_WALL_S"  # read by ``dask_setup``


@dataclass(frozen=True)
class EmulatedWeights:
    """A published version, as the emulated tasks see it (no file behind it)."""

    version: int


@dataclass(frozen=True)
class EmulatedGenSpec:
    """What an emulated generation task needs (the emulated ``GenSpec``)."""

    profile: Profile
    n_samples: int
    time_scale: float  # wall seconds per emulated second
    cap: int  # engine cap on live sequences per worker
    max_new_tokens: int


@dataclass(frozen=True)
class EmulatedTrainSpec:
    """What the emulated update needs (the emulated ``TrainSpec``)."""

    profile: Profile
    train_gpus: int
    time_scale: float


_STATE = {"version": 0}  # policy version this worker's emulated engine holds
_PAUSED: dict[str, tuple[WorkerRun, pa.Table, float, float]] = {}  # key -> paused chunk


def dask_setup(worker) -> None:
    """Dask preload: the cold start, counted from this worker process's start, slept before
    the worker registers with the scheduler."""
    cold = float(os.environ.get(COLD_START_ENV, "0"))
    age = time.time() - psutil.Process().create_time()
    time.sleep(max(0.0, cold - age))


def _worker_name() -> str:
    try:
        return str(get_worker().name)
    except ValueError:  # outside a worker (tests)
        return "local"


def _sleep_until(started: float, emulated_s: float, scale: float) -> float:
    """Sleep until ``emulated_s`` after ``started``; returns the wall seconds the task ran
    past that (its own work took longer, or the process got no CPU in time)."""
    time.sleep(max(0.0, started + emulated_s * scale - time.time()))
    return time.time() - (started + emulated_s * scale)


def _sync(weights: EmulatedWeights, spec: EmulatedGenSpec) -> float:
    """Emulated seconds of fetching ``weights`` (0 when this worker holds them)."""
    if _STATE["version"] == weights.version:
        return 0.0
    _STATE["version"] = weights.version
    return spec.profile.sync_s


def _expand(shard: pa.Table, n_samples: int) -> tuple[pa.Table, np.ndarray]:
    """One row per (prompt, sample), prompt-major, with its response length (``LENGTH``)."""
    rows = shard.take(np.repeat(np.arange(len(shard)), n_samples)).drop_columns([LENGTHS])
    rows = rows.append_column("sample_idx", pa.array(
        np.tile(np.arange(n_samples, dtype=np.int32), len(shard))))
    lengths = np.asarray(shard.column(LENGTHS).combine_chunks().flatten(), dtype=np.int64)
    return rows.append_column(LENGTH, pa.array(lengths)), lengths


def _lengths(column) -> np.ndarray:
    """Lengths of a list column's rows (no Python lists built)."""
    return pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)


def _tokens(counts: np.ndarray, values: pa.DataType) -> pa.ListArray:
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(
        np.zeros(int(offsets[-1])), values))


def _rollouts(rows: pa.Table, lengths: np.ndarray, spec: EmulatedGenSpec, start: float,
              end: float) -> pa.Table:
    """``rows`` (prompt columns + ``sample_idx``) completed to ``ROLLOUTS``."""
    n = len(rows)
    columns = {name: rows.column(name) for name in ROLLOUTS.names[:5]}
    columns |= {
        "response_ids": _tokens(lengths, pa.int32()),
        "response_text": pa.array([str(x % 2) for x in lengths.tolist()], pa.string()),
        "logprobs": _tokens(lengths, pa.float32()),
        "finish_reason": pa.array(np.where(lengths >= spec.max_new_tokens, "length", "stop")),
        "policy_version": pa.array(np.full(n, _STATE["version"]), pa.int64()),
        "worker": pa.array([_worker_name()] * n, pa.string()),
        "gen_start": pa.array(np.full(n, start)), "gen_end": pa.array(np.full(n, end)),
    }
    return pa.Table.from_pydict(columns, schema=ROLLOUTS)


def _stamp(table: pa.Table, run: WorkerRun, spec: EmulatedGenSpec, emulated_s: float,
           late_wall_s: float) -> Generated:
    """``table`` beside the generation statistics of ``run`` (emulated seconds), the figures
    a real engine reports, and the wall seconds the task ran late."""
    prefill = int(run.prefill.sum())
    return Generated(table, GenerationStats(
        prefill_tokens=prefill, prefill_seconds=prefill / spec.profile.prefill_tokens_per_s,
        decode_tokens=int(run.batch.sum()), decode_steps=int(run.n_steps),
        decode_seconds=float(run.decode_s.sum()), gen_seconds=emulated_s,
        late_wall_s=late_wall_s))


def _schedule(shard: pa.Table, spec: EmulatedGenSpec, t0: float) -> tuple[pa.Table, np.ndarray,
                                                                           WorkerRun]:
    rows, lengths = _expand(shard, spec.n_samples)
    prompt = _lengths(rows.column("prompt_ids"))
    prefill = np.zeros(len(rows))
    prefill[::spec.n_samples] = prompt[::spec.n_samples]  # each group's prompt once
    run = simulate_run(t0, np.arange(len(rows)), lengths, prompt, prefill, spec.profile,
                       spec.cap)
    return rows, lengths, run


def generate_task(shard: pa.Table, weights: EmulatedWeights, spec: EmulatedGenSpec,
                  seed: int) -> Generated:
    """Rollouts of the whole shard (the static policy's generate)."""
    started = time.time()
    rows, lengths, run = _schedule(shard, spec, _sync(weights, spec))
    table = _rollouts(rows, lengths, spec, started, started + run.t_finish * spec.time_scale)
    late = _sleep_until(started, run.t_finish, spec.time_scale)
    return _stamp(table, run, spec, run.t_finish, late)


def generate_chunk_task(shard: pa.Table, weights: EmulatedWeights, spec: EmulatedGenSpec,
                        seed: int, until_finished: float, key: str) -> dict:
    """Generate until ``until_finished`` of the shard's sequences are done; the rest stay
    paused here under ``key``. Returns ``{"done": rollouts, "cut": unfinished rows}`` with
    ``partial_ids`` / ``partial_logprobs`` (the tokens so far), as the hf engine does."""
    started = time.time()
    rows, lengths, run = _schedule(shard, spec, _sync(weights, spec))
    finish = np.sort(run.finish_times())
    k = max(1, math.ceil(until_finished * finish.size))
    t_cut = float(finish[k - 1]) if finish.size else 0.0
    done, generated, _ = run.state_at(t_cut)
    paused = np.flatnonzero(~done)
    end = started + t_cut * spec.time_scale
    table = _rollouts(rows.filter(pa.array(done)), lengths[done], spec, started, end)
    cut = rows.take(paused)
    cut = cut.append_column("partial_ids", _tokens(generated[paused], pa.int32()))
    cut = cut.append_column("partial_logprobs", _tokens(generated[paused], pa.float32()))
    if paused.size:
        _PAUSED[key] = (run, rows.take(paused), t_cut, started)
    late = _sleep_until(started, t_cut, spec.time_scale)
    return {"done": _stamp(table, run.cut(t_cut), spec, t_cut, late), "cut": cut}


def resume_task(key: str, weights: EmulatedWeights, spec: EmulatedGenSpec) -> Generated:
    """Finish the paused chunk ``key`` here: the rest of its schedule (the *stay* side)."""
    run, rows, t_cut, chunk_started = _PAUSED.pop(key)
    started = time.time()
    emulated_s = run.t_finish - t_cut
    tail = ~run.state_at(t_cut)[0]
    rest = WorkerRun(t_cut, run.seq[tail], run.start[tail], run.end[tail], run.done[tail],
                     run.ctx0[tail], np.zeros(int(tail.sum())),
                     run.t_step[run.steps_done(t_cut):], run.batch[run.steps_done(t_cut):],
                     run.decode_s[run.steps_done(t_cut):], run.gpus)
    lengths = run.end[tail] - run.start[tail]
    table = _rollouts(rows, lengths, spec, chunk_started,
                      started + emulated_s * spec.time_scale)
    late = _sleep_until(started, emulated_s, spec.time_scale)
    return _stamp(table, rest, spec, emulated_s, late)


def drop_task(key: str) -> bool:
    """Forget the paused chunk ``key`` (its tail was moved elsewhere)."""
    return _PAUSED.pop(key, None) is not None


def continue_task(cut: pa.Table, weights: EmulatedWeights, spec: EmulatedGenSpec,
                  seed: int) -> Generated:
    """Continue sequences cut on another worker: prompt + generated tokens prefilled again,
    then the rest decoded (the *move* side)."""
    started = time.time()
    t0 = _sync(weights, spec)
    generated, prompt = _lengths(cut.column("partial_ids")), _lengths(cut.column("prompt_ids"))
    lengths = cut.column(LENGTH).to_numpy()
    run = simulate_run(t0, np.arange(len(cut)), np.maximum(lengths - generated, 1),
                       prompt + generated, (prompt + generated).astype(float), spec.profile,
                       spec.cap)
    table = _rollouts(cut, lengths, spec, started, started + run.t_finish * spec.time_scale)
    late = _sleep_until(started, run.t_finish, spec.time_scale)
    return _stamp(table, run, spec, run.t_finish, late)


def update_task(shards: list[Generated], weights: EmulatedWeights,
                spec: EmulatedTrainSpec) -> dict:
    """The update's time on the profile's learner: forward-only passes and the update over
    prompt + response tokens. Returns the metrics the driver reads (emulated seconds)."""
    started = time.time()
    trainables = [s.table for s in shards]
    tokens = float(sum(_lengths(t.column("prompt_ids")).sum()
                       + _lengths(t.column("response_ids")).sum() for t in trainables))
    prof = spec.profile
    emulated_s = (prof.forward_seconds(tokens, spec.train_gpus)
                  + prof.update_seconds(tokens, spec.train_gpus))
    rows = sum(len(t) for t in trainables)
    late = _sleep_until(started, emulated_s, spec.time_scale)
    return {"update_seconds": emulated_s, "update_tokens": tokens, "rows": rows,
            "late_wall_s": late,
            "reward_mean": float(np.mean(np.concatenate(
                [t.column("reward").to_numpy() for t in trainables]))) if rows else 0.0}


def publish_task(metrics: dict, spec: EmulatedTrainSpec, version: int) -> EmulatedWeights:
    """The new version (after ``metrics``' update), nothing written."""
    return EmulatedWeights(version)
