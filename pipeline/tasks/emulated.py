"""The emulated engine and trainer: the time a GPU profile says, no tensor work.

``backend = "emulated"`` runs the same ``train(cfg)`` as every engine, with this module's
``EmulatedEngine`` as the generation engine (it implements the engine protocol,
``ops/engine/protocol.py``) and ``EmulatedTrainer`` as the trainer's state
(``trainer.py`` builds it when ``TrainSpec.emulate`` is set): both sleep for what the
simulator's GPU profile (``schedulers/profiles.py``) says their work would take, so that a
pool of many generation workers fits on one small machine (this module imports neither torch
nor transformers: a worker that runs only these stays small). Everything around them is the
real runtime: Dask scheduler and worker processes, the elasticity plugin, scaling,
assignment, tail handling, the ledger, Arrow tables between stages, checkpoints, evaluation.
Which prompts, lengths, profile and learner: ``pipeline/train/emulation.py``.

What is emulated, and from where:

- response lengths: each prompt row carries ``emulated_lengths`` (its group's lengths, from a
  workload trace, ``schedulers/sim/workloads.py``); a response is that many tokens;
- a shard's decode: continuous batching under the profile's step model, by the simulator's
  own engine (``sim_engine.simulate_run``: decode step time by batch and context, prefill
  charged in the step that admits a sequence, the engine's batch cap); each group's prompt is
  prefilled once (prefix sharing);
- ``generate_until`` stops at the step boundary where ``until_finished`` of the sequences are
  done, or at the first step boundary after the stop rule's pause or deadline (checked as it
  sleeps); ``resume`` runs the rest of the same schedule, ``continue_rows`` reschedules cut
  sequences on another worker, recomputing prompt + generated tokens as prefill;
- a paused tail's KV cache moves as data (``emulated_tails.py``: exported, adopted, its
  transfer timed by PAT's link model), so the elastic policy may move, split or consolidate
  tails as with our engine; ``widen`` is PAT's reconfiguration, the profile re-derived at a
  TP that many times larger (the widest feasible), ``pat.RECONFIG_FIXED_S`` charged once
  before its next step, the sources' GPUs held by it (``reconfig_releases`` false);
- the trace's decode spans and the pause at ``tau`` (``record_steps``), on the wall clock
  the task sleeps through, each span's tokens its steps' live batches;
- weight load: ``profile.sync_s`` when a task needs a newer version than the engine holds,
  at the start of its schedule;
- cold start: ``profile.gen_cold_start_s`` from the worker process's start, slept in a Dask
  preload (``dask_setup``) before the worker registers, so the scheduler, the ledger and the
  policy see it as the worker's start-up;
- the update: the profile's forward-only passes plus ``update_seconds`` over prompt +
  response tokens on ``train_gpus`` learner GPUs.

An emulated second lasts ``time_scale`` wall seconds; every duration reported is in emulated
seconds. A task sleeps until its start plus its emulated duration times the scale, so its own
bookkeeping (building tables) is inside that duration when it is shorter; ``late_wall_s``
says by how much it ran past. Responses are ``length`` zero tokens with zero
log-probabilities; ``response_text`` is the length's parity (``"0"`` or ``"1"``), so a prompt
whose ``answer`` is ``"0"`` scores 1 with the ``exact`` verifier for an even length: a
deterministic reward from the trace.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import numpy as np
import psutil
import pyarrow as pa
import zarr

from rlhfless.ops.data.schema import ROLLOUTS
from rlhfless.ops.engine import phases
from rlhfless.ops.engine.engine_types import (
    TAIL_ACTIONS,
    Chunk,
    EngineSpec,
    SamplingParams,
    StopRule,
    WeightsRef,
)
from rlhfless.ops.engine.gen_stats import Generated, GenerationStats
from rlhfless.ops.engine.protocol import GenerationBackend
from rlhfless.schedulers.pat import RECONFIG_FIXED_S
from rlhfless.schedulers.profiles import Profile, get_profile
from rlhfless.schedulers.sim.engine import WorkerRun, simulate_run

from . import emulated_tails as tails
from .emulated_tails import LENGTH, Paused
from .emulated_tails import lengths_of as _lengths

LENGTHS = "emulated_lengths"  # prompt column: the trace's response lengths of its group
DEFAULT_PROFILE = "Qwen2.5-3B@L40S"
PAUSE_POLL_S = 0.01  # wall seconds between looks at the stop rule while a chunk sleeps
COLD_START_ENV = "RLHFLESS_EMULATED_COLD_START_WALL_S"  # read by ``dask_setup``
WEIGHTS_PATH = "emulated"  # where an emulated version "lives": nowhere


def dask_setup(worker) -> None:
    """Dask preload: the cold start, counted from this worker process's start, slept before
    the worker registers with the scheduler."""
    cold = float(os.environ.get(COLD_START_ENV, "0"))
    age = time.time() - psutil.Process().create_time()
    time.sleep(max(0.0, cold - age))


def _sleep_until(started: float, emulated_s: float, scale: float) -> float:
    """Sleep until ``emulated_s`` after ``started``; returns the wall seconds the task ran
    past that (its own work took longer, or the process got no CPU in time)."""
    time.sleep(max(0.0, started + emulated_s * scale - time.time()))
    return time.time() - (started + emulated_s * scale)


def _tokens(counts: np.ndarray, values: pa.DataType) -> pa.ListArray:
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(
        np.zeros(int(offsets[-1])), values))


def record_steps(run: WorkerRun, wall0: float, t0: float, scale: float, lo: int = 0,
                 hi: int | None = None) -> None:
    """``run``'s decode steps ``lo..hi`` as the trace's decode spans (``phases``), emulated
    time ``t0`` being wall ``wall0``: at most ``DECODE_SPAN_S`` of wall time each, with the
    tokens the steps sampled (their live batches)."""
    hi = run.n_steps if hi is None else hi
    if hi <= lo:
        return
    ends = wall0 + (run.t_step[lo:hi] - t0) * scale
    starts = np.append(wall0 + (float(run.t_step[lo - 1]) - t0) * scale if lo else wall0,
                       ends[:-1])
    span = ((ends - ends[0]) // phases.DECODE_SPAN_S).astype(np.int64)
    for k in np.unique(span):
        at = np.flatnonzero(span == k)
        phases.record("decode", float(starts[at[0]]), float(ends[at[-1]]),
                      tokens=int(run.batch[lo:hi][at].sum()), steps=int(at.size))


def expand(prompts: pa.Table, n_samples: int) -> tuple[pa.Table, np.ndarray]:
    """One row per (prompt, sample), prompt-major, with its response length (``LENGTH``):
    the first ``n_samples`` of its group's trace lengths."""
    rows = prompts.take(np.repeat(np.arange(len(prompts)), n_samples)).drop_columns([LENGTHS])
    rows = rows.append_column("sample_idx", pa.array(
        np.tile(np.arange(n_samples, dtype=np.int32), len(prompts))))
    group = prompts.column(LENGTHS).to_pylist()
    if any(len(g) < n_samples for g in group):
        raise ValueError(f"emulated engine: a prompt's {LENGTHS} holds fewer than "
                         f"{n_samples} lengths")
    lengths = np.array([g[:n_samples] for g in group], dtype=np.int64).reshape(-1)
    return rows.append_column(LENGTH, pa.array(lengths)), lengths


class EmulatedEngine(GenerationBackend):
    """An engine that sleeps on the profile's clock; see the module docstring."""

    computes = False
    exports_kv = True
    tail_actions = frozenset(TAIL_ACTIONS)
    reconfig_releases = False

    def __init__(self, model_path: str, profile: str = DEFAULT_PROFILE,
                 time_scale: float = 0.05, cap: int = 0) -> None:
        self.model_path = model_path
        self.base: Profile = get_profile(profile)
        self.profile = self.base  # at the engine's width (``widen``)
        self.width = 1
        self.time_scale = time_scale
        self.cap = cap  # live sequences per worker; 0: the profile's at the shard's context
        self.pending_sync_s = 0.0  # a new version's load, charged to the next schedule
        self.pending_reconfig_s = 0.0  # a widening's fixed cost, charged to the next one

    @staticmethod
    def _spec_profile(spec: EngineSpec) -> Profile:
        return get_profile(spec.options.get("profile", DEFAULT_PROFILE))

    @classmethod
    def kv_bytes_per_token(cls, spec: EngineSpec) -> float:
        return cls._spec_profile(spec).kv_bytes_per_token

    @classmethod
    def kv_link_bytes_per_s(cls, spec: EngineSpec) -> float:
        return tails.link_bytes_per_s(cls._spec_profile(spec))

    def widen(self, width: int) -> int:
        """PAT's reconfiguration: the profile at ``width`` times the base TP (the widest
        feasible TP up to it), its fixed cost charged before the next step; the width
        before. Narrowing back costs nothing (and drops a widening never used)."""
        if width < 1:
            raise ValueError(f"widen: width={width}; allowed: >= 1")
        before, self.width = self.width, width
        tp = max([t for t in self.base.feasible_tps() if t <= self.base.tp * width],
                 default=self.base.tp)
        self.profile = self.base if tp == self.base.tp else self.base.variant(tp=tp)
        self.pending_reconfig_s = RECONFIG_FIXED_S if width > 1 and width != before else 0.0
        return before

    def load(self) -> None:
        """Nothing to load: the cold start is slept before the worker registers."""

    def close(self) -> None:
        """Nothing to release."""

    def set_weights(self, ref: WeightsRef) -> None:
        self.version = ref.version
        self.pending_sync_s = self.profile.sync_s

    def reset_prefix_cache(self) -> None:
        """No cache is kept."""

    def sleep(self) -> None:
        """Never colocated."""

    def wake(self) -> None:
        """Never asleep."""

    @property
    def tokenizer(self):
        return None

    @property
    def max_context(self) -> int | None:
        return None

    def step_seconds(self, batch: int, steps: int, prompt_tokens: int) -> float:
        ctx = batch * (prompt_tokens + np.arange(steps) + 1)
        return float(np.mean(self.profile.step_seconds(np.full(steps, batch), ctx)))

    def decode_turns(self, turns, params, stats, *, keep_cache=True, on_leave=None) -> None:
        raise NotImplementedError("the emulated engine generates single-turn rollouts only")

    # ---- generation --------------------------------------------------------------------

    def _t0(self) -> float:
        """Emulated seconds before the first step: a new version's load and a widening's
        fixed cost, once."""
        t0 = self.pending_sync_s + self.pending_reconfig_s
        self.pending_sync_s = self.pending_reconfig_s = 0.0
        return t0

    def _cap(self, prompt: np.ndarray, lengths: np.ndarray) -> int:
        if self.cap and self.width == 1:
            return self.cap
        return self.profile.batch_cap(float(prompt.mean() + lengths.mean()) if prompt.size
                                      else 1.0)

    def _schedule(self, prompts: pa.Table, n_samples: int) -> tuple[pa.Table, np.ndarray,
                                                                    WorkerRun]:
        rows, lengths = expand(prompts, n_samples)
        prompt = _lengths(rows.column("prompt_ids"))
        prefill = np.zeros(len(rows))
        prefill[::n_samples] = prompt[::n_samples]  # each group's prompt once
        run = simulate_run(self._t0(), np.arange(len(rows)), lengths, prompt, prefill,
                           self.profile, self._cap(prompt, lengths))
        return rows, lengths, run

    def _rollouts(self, rows: pa.Table, lengths: np.ndarray, params: SamplingParams,
                  worker: str, start: float, end: float) -> pa.Table:
        """``rows`` (prompt columns + ``sample_idx``) completed to ``ROLLOUTS``."""
        n = len(rows)
        columns = {name: rows.column(name) for name in ROLLOUTS.names[:5]}
        columns |= {
            "response_ids": _tokens(lengths, pa.int32()),
            "response_text": pa.array([str(x % 2) for x in lengths.tolist()], pa.string()),
            "logprobs": _tokens(lengths, pa.float32()),
            "finish_reason": pa.array(np.where(lengths >= params.max_new_tokens, "length",
                                               "stop")),
            "policy_version": pa.array(np.full(n, self.version), pa.int64()),
            "worker": pa.array([worker] * n, pa.string()),
            "gen_start": pa.array(np.full(n, start)), "gen_end": pa.array(np.full(n, end)),
        }
        return pa.Table.from_pydict(columns, schema=ROLLOUTS)

    def _stats(self, run: WorkerRun, emulated_s: float, late_wall_s: float,
                admitted: bool = True) -> GenerationStats:
        """The figures a real engine reports, of ``run`` (emulated seconds); ``admitted``:
        its sequences were taken in here (not a resumed schedule's), each a request whose
        context was prefilled or, a group's prompt after its first sample, reused."""
        prefill = int(run.prefill.sum())
        return GenerationStats(
            prefill_tokens=prefill, prefill_seconds=prefill / self.profile.prefill_tokens_per_s,
            prefill_reused_tokens=int(run.ctx0.sum()) - prefill if admitted else 0,
            prefill_requests=int(run.seq.size) if admitted else 0,
            decode_tokens=int(run.batch.sum()), decode_steps=int(run.n_steps),
            decode_seconds=float(run.decode_s.sum()), gen_seconds=emulated_s,
            late_wall_s=late_wall_s)

    def generate(self, prompts: pa.Table, n_samples: int, params: SamplingParams, *,
                 worker: str = "local",
                 share_prefixes: bool = True) -> tuple[pa.Table, GenerationStats]:
        started = time.time()
        rows, lengths, run = self._schedule(prompts, n_samples)
        table = self._rollouts(rows, lengths, params, worker, started,
                               started + run.t_finish * self.time_scale)
        record_steps(run, started, 0.0, self.time_scale)
        late = _sleep_until(started, run.t_finish, self.time_scale)
        return table, self._stats(run, run.t_finish, late)

    def generate_until(self, prompts: pa.Table, n_samples: int, params: SamplingParams,
                       stop: StopRule, *, worker: str = "local",
                       share_prefixes: bool = True) -> Chunk:
        started = time.time()
        rows, lengths, run = self._schedule(prompts, n_samples)
        finish = np.sort(run.finish_times())
        k = max(1, math.ceil(stop.until_finished * finish.size))
        t_cut = float(finish[k - 1]) if finish.size else 0.0
        t_cut, by = self._sleep_or_stop(started, t_cut, run, stop)
        done, generated, _ = run.state_at(t_cut)
        paused = np.flatnonzero(~done)
        table = self._rollouts(rows.filter(pa.array(done)), lengths[done], params, worker,
                               started, started + t_cut * self.time_scale)
        cut = rows.take(paused)
        cut = cut.append_column("partial_ids", _tokens(generated[paused], pa.int32()))
        cut = cut.append_column("partial_logprobs", _tokens(generated[paused], pa.float32()))
        handle = Paused(rows.take(paused), generated[paused], np.ones(paused.size, bool),
                        started, run, t_cut) if paused.size else None
        record_steps(run, started, 0.0, self.time_scale, hi=run.steps_done(t_cut))
        if paused.size:
            at = started + t_cut * self.time_scale
            phases.record("pause", at, at, rows=int(paused.size), by=by)
        late = _sleep_until(started, t_cut, self.time_scale)
        return Chunk(table, cut, self._stats(run.cut(t_cut), t_cut, late), handle)

    def _sleep_or_stop(self, started: float, t_cut: float, run: WorkerRun,
                       stop: StopRule) -> tuple[float, str]:
        """Sleep towards ``t_cut`` (emulated) looking at the stop rule's pause and deadline
        every ``PAUSE_POLL_S``: where one says stop, the cut moves to the end of the step
        running then. Returns the cut and what made it ("tau" or "pause")."""
        if stop.pause is None and stop.deadline is None:
            return t_cut, "tau"
        end = started + t_cut * self.time_scale
        while (now := time.time()) < end:
            if stop.interrupted():
                step = run.steps_done((now - started) / self.time_scale)
                if step < run.n_steps and float(run.t_step[step]) < t_cut:
                    return float(run.t_step[step]), "pause"
                return t_cut, "tau"
            time.sleep(min(PAUSE_POLL_S, end - now))
        return t_cut, "tau"

    def resume(self, paused: Paused, params: SamplingParams, *,
               worker: str = "local") -> tuple[pa.Table, GenerationStats]:
        if paused.run is None:  # part of it left, or it was adopted: scheduled again
            return self._reschedule(paused, params, worker, admitted=False)
        run, t_cut = paused.run, paused.t_cut
        started = time.time()
        emulated_s = run.t_finish - t_cut
        tail = ~run.state_at(t_cut)[0]
        step = run.steps_done(t_cut)
        rest = WorkerRun(t_cut, run.seq[tail], run.start[tail], run.end[tail], run.done[tail],
                         run.ctx0[tail], np.zeros(int(tail.sum())), run.t_step[step:],
                         run.batch[step:], run.decode_s[step:], run.gpus)
        lengths = run.end[tail] - run.start[tail]
        table = self._rollouts(paused.rows, lengths, params, worker, paused.started,
                               started + emulated_s * self.time_scale)
        record_steps(run, started, t_cut, self.time_scale, lo=step)
        late = _sleep_until(started, emulated_s, self.time_scale)
        return table, self._stats(rest, emulated_s, late, admitted=False)

    def continue_rows(self, cut: pa.Table, params: SamplingParams, *,
                      worker: str = "local") -> tuple[pa.Table, GenerationStats]:
        generated = _lengths(cut.column("partial_ids"))
        return self._reschedule(Paused(cut, generated, np.zeros(len(cut), bool), time.time()),
                                params, worker, admitted=True)

    def _reschedule(self, paused: Paused, params: SamplingParams, worker: str,
                    admitted: bool) -> tuple[pa.Table, GenerationStats]:
        """Decode ``paused``'s sequences from where they are, on this engine at its width:
        those whose KV is here go on, the others have their context prefilled as admitted,
        after ``paused.load_s`` (its KV landing)."""
        started = time.time()
        prompt = _lengths(paused.rows.column("prompt_ids"))
        lengths = paused.rows.column(LENGTH).to_numpy().astype(np.int64)
        context = prompt + paused.generated
        run = simulate_run(self._t0() + paused.load_s, np.arange(len(lengths)),
                           np.maximum(lengths - paused.generated, 1), context,
                           np.where(paused.kv, 0.0, context.astype(float)), self.profile,
                           self._cap(prompt, lengths))
        table = self._rollouts(paused.rows, lengths, params, worker,
                               started if admitted else paused.started,
                               started + run.t_finish * self.time_scale)
        record_steps(run, started, 0.0, self.time_scale)
        late = _sleep_until(started, run.t_finish, self.time_scale)
        return table, self._stats(run, run.t_finish, late, admitted=admitted)

    def export_paused(self, paused: Paused, positions: list[int] | None = None
                      ) -> tails.EmulatedTail:
        return tails.export(paused, positions, self.profile)

    def adopt(self, exported: list[tails.EmulatedTail], recompute: pa.Table | None,
              params: SamplingParams, stats: GenerationStats) -> Paused:
        """One paused decoding of ``exported`` and ``recompute`` (``emulated_tails.adopt``);
        ``stats`` gets the KV landing and the recomputation on the profile's clock."""
        paused = tails.adopt(exported, recompute, self.profile)
        redo = float(paused.context[~paused.kv].sum())
        stats.prefill_tokens += int(redo)
        stats.prefill_seconds += redo / self.profile.prefill_tokens_per_s
        stats.kv_load_seconds += paused.load_s
        return paused


# ---- the trainer ----------------------------------------------------------------------

@dataclass(frozen=True)
class EmulatedLearner:
    """What the emulated trainer needs (``TrainSpec.emulate``): the profile's learner."""

    profile: str
    train_gpus: int
    time_scale: float


class EmulatedTrainer:
    """The trainer's state on the profile's clock: a policy version and the driver's token,
    no weights. Same methods as the trainer of ``trainer.py``."""

    def __init__(self, learner: EmulatedLearner) -> None:
        self.learner, self.profile = learner, get_profile(learner.profile)
        self.version, self.token, self.cold_start_s = 0, None, 0.0

    def update(self, trainables: list[Generated], spec) -> dict:
        """The update's time on the profile's learner: forward-only passes and the update
        over prompt + response tokens. Returns the metrics the driver reads (emulated s)."""
        started = time.time()
        tables = [s.table for s in trainables]
        tokens = float(sum(_lengths(t.column("prompt_ids")).sum()
                           + _lengths(t.column("response_ids")).sum() for t in tables))
        gpus = self.learner.train_gpus
        emulated_s = (self.profile.forward_seconds(tokens, gpus)
                      + self.profile.update_seconds(tokens, gpus))
        late = _sleep_until(started, emulated_s, self.learner.time_scale)
        return {"update_seconds": emulated_s, "update_tokens": tokens,
                "update_rows": sum(len(t) for t in tables), "late_wall_s": late,
                "lr": spec.update.lr, "trainer_cold_start_s": 0.0}

    def publish(self, spec, version: int) -> WeightsRef:
        """Version ``version`` (after the update), nothing written."""
        self.version = version
        return WeightsRef(version, WEIGHTS_PATH)

    def save(self, path: str, spec) -> dict:
        """The trainer's part of a checkpoint (the group ``trainer`` of its zarr store, as
        the real trainer's): its version, nothing else."""
        zarr.open_group(path, mode="r+").create_group(
            "trainer", attributes={"emulated_version": self.version})
        return {"version": self.version, "bytes": 0, "finite": True, "seconds": 0.0}

    def restore(self, path: str, spec) -> int:
        group = zarr.open_group(path, mode="r")["trainer"]
        self.version = int(group.attrs["emulated_version"])
        return self.version
