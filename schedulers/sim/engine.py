"""One generation worker's continuous batching, in closed form between events.

A worker runs its sequences under continuous batching: at most ``cap`` live sequences; a
finished one leaves at once and the next queued one is admitted (first come, first served),
paying its prefill inside that step. The *step schedule* — at which decode step each sequence
is admitted and finishes — does not depend on how long steps take, so it is computed first
(all at step 0 when everything fits, otherwise list scheduling with a heap: one Python
operation per queued sequence, never per token). Step durations then follow, vectorised over
steps, from the profile's step model::

    t(s) = base + per_seq * live(s) + per_ctx * ctx(s) + prefill_tokens(s) / prefill_rate

with ``live(s)`` and ``ctx(s)`` (context tokens of the live sequences) built from difference
arrays over the admission and finish steps. The result is a ``WorkerRun``: the time at the
end of every step, from which finish times, the state at any instant (for cut-and-migrate)
and the per-step batch (for utilisation and throughput fits) are read.

Simplifications: a cut or migration at time ``t`` happens at the last step boundary before
``t`` (the step in flight is redone); prefill of queued sequences is charged to the step that
admits them (chunked prefill); there is no preemption or KV swapping.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from ..profiles import Profile


@dataclass(frozen=True, eq=False)
class WorkerRun:
    """A worker's schedule from ``t0`` until its last sequence finishes (or a cut)."""

    t0: float
    seq: np.ndarray  # [n] global sequence ids, in admission order
    start: np.ndarray  # [n] decode step at which each sequence is admitted (0-based)
    end: np.ndarray  # [n] step after its last token here (end - start: tokens decoded here)
    done: np.ndarray  # [n] bool: the sequence finished in this run
    ctx0: np.ndarray  # [n] context tokens on admission (prompt + tokens generated earlier)
    prefill: np.ndarray  # [n] tokens prefilled on admission
    t_step: np.ndarray  # [S] absolute time at the end of each step
    batch: np.ndarray  # [S] live sequences during each step
    decode_s: np.ndarray  # [S] decode part of each step's seconds (prefill excluded)
    gpus: int = 1  # GPUs of the worker (its TP)

    @property
    def n_steps(self) -> int:
        return int(self.t_step.size)

    @property
    def t_finish(self) -> float:
        """When the last sequence finishes (``t0`` for an empty run)."""
        return float(self.t_step[-1]) if self.t_step.size else float(self.t0)

    def finish_times(self) -> np.ndarray:
        """[n] absolute finish time of each sequence (inf if the run was cut before it)."""
        out = np.full(self.seq.size, np.inf)
        out[self.done] = self.t_step[self.end[self.done] - 1]
        return out

    def steps_done(self, t: float) -> int:
        """Decode steps completed by time ``t``."""
        return int(np.searchsorted(self.t_step, t, side="right"))

    def state_at(self, t: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """At time ``t``: (finished mask, tokens generated in this run, admitted mask), [n]."""
        k = self.steps_done(t)
        generated = np.clip(k - self.start, 0, self.end - self.start)
        return self.done & (self.end <= k), generated, self.start < k

    def cut(self, t: float) -> WorkerRun:
        """This run stopped at the last step boundary before ``t``; unfinished sequences
        keep the tokens generated so far (``state_at``) and are resumed elsewhere."""
        k = self.steps_done(t)
        return WorkerRun(self.t0, self.seq, self.start, np.clip(self.end, None, np.maximum(
            k, self.start)), self.done & (self.end <= k), self.ctx0, self.prefill,
            self.t_step[:k], self.batch[:k], self.decode_s[:k], self.gpus)

    def chunks(self, n_chunks: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Decode observations for ``ThroughputModel.observe_decode``: the steps split into
        up to ``n_chunks`` runs, each as (mean live batch, mean decode seconds, steps)."""
        if self.n_steps == 0:
            return np.zeros(0), np.zeros(0), np.zeros(0)
        parts = np.array_split(np.arange(self.n_steps), min(n_chunks, self.n_steps))
        b = np.array([self.batch[p].mean() for p in parts])
        s = np.array([self.decode_s[p].mean() for p in parts])
        return b, s, np.array([p.size for p in parts], dtype=np.float64)


def admission_steps(remaining: np.ndarray, cap: int | None) -> np.ndarray:
    """[n] step at which each sequence (in admission order) starts, with ``cap`` slots."""
    n = remaining.size
    start = np.zeros(n, dtype=np.int64)
    if cap is None or n <= cap:
        return start
    slots = remaining[:cap].astype(np.int64).tolist()  # end step of each occupied slot
    heapq.heapify(slots)
    rem = remaining.astype(np.int64).tolist()
    for i in range(cap, n):
        s = heapq.heappop(slots)
        start[i] = s
        heapq.heappush(slots, s + rem[i])
    return start


def simulate_run(
    t0: float,
    seq: np.ndarray,
    remaining: np.ndarray,
    ctx0: np.ndarray,
    prefill: np.ndarray,
    profile: Profile,
    cap: int | None,
) -> WorkerRun:
    """Schedule ``seq`` (admission order) on one worker from time ``t0``.

    ``remaining``: [n] tokens each sequence still has to decode (>= 1); ``ctx0``: [n] its
    context on admission; ``prefill``: [n] tokens prefilled on admission (0 for sequences
    already live on this worker, the prompt for new ones, prompt + generated for migrated
    ones). Sequences admitted at step 0 are prefilled before the first decode step.
    """
    seq = np.asarray(seq, dtype=np.int64)
    rem = np.asarray(remaining, dtype=np.int64)
    if rem.size and rem.min() < 1:
        raise ValueError(f"simulate_run: remaining tokens must be >= 1, got min {rem.min()}")
    ctx0 = np.asarray(ctx0, dtype=np.float64)
    prefill = np.asarray(prefill, dtype=np.float64)
    if not (seq.size == rem.size == ctx0.size == prefill.size):
        raise ValueError("simulate_run: seq, remaining, ctx0 and prefill must have one entry "
                         f"per sequence; got {seq.size}, {rem.size}, {ctx0.size}, {prefill.size}")
    if seq.size == 0:
        empty = np.zeros(0)
        return WorkerRun(t0, seq, seq, seq, np.zeros(0, bool), empty, empty, empty,
                         np.zeros(0, np.int64), empty, profile.tp)
    start = admission_steps(rem, cap)
    end = start + rem
    n_steps = int(end.max())
    m = n_steps + 1
    live = np.cumsum(np.bincount(start, minlength=m) - np.bincount(end, minlength=m))[:n_steps]
    w = ctx0 - start  # ctx of a live sequence at step s is ctx0 + (s - start)
    ctx = np.cumsum(np.bincount(start, weights=w, minlength=m)
                    - np.bincount(end, weights=w, minlength=m))[:n_steps]
    ctx = ctx + np.arange(n_steps) * live
    decode_s = profile.step_seconds(live, ctx)
    prefill_s = np.bincount(start, weights=prefill, minlength=m)[:n_steps]
    prefill_s = prefill_s / profile.prefill_tokens_per_s
    t_step = t0 + np.cumsum(decode_s + prefill_s)
    done = np.ones(seq.size, dtype=bool)
    return WorkerRun(float(t0), seq, start, end, done, ctx0, prefill, t_step, live, decode_s,
                     profile.tp)


def resume_run(
    t: float,
    run: WorkerRun,
    incoming_seq: np.ndarray,
    incoming_remaining: np.ndarray,
    incoming_ctx: np.ndarray,
    profile: Profile,
    cap: int | None,
    incoming_prefill: np.ndarray | None = None,
) -> WorkerRun:
    """A new run from ``t`` for a worker whose current (uncut) ``run`` stops at ``t``: its
    unfinished sequences continue (live ones first, then its queue), and the migrated
    sequences join the end of the queue, paying ``incoming_prefill`` prefill tokens each
    (default: their whole context, recomputed; a KV transfer is charged as the prefill
    tokens that take as long)."""
    _, generated, admitted = run.state_at(t)
    left = (run.end - run.start) - generated
    keep = left > 0
    order = np.concatenate([np.flatnonzero(keep & admitted), np.flatnonzero(keep & ~admitted)])
    incoming_ctx = np.asarray(incoming_ctx, dtype=np.float64)
    seq = np.concatenate([run.seq[order], np.asarray(incoming_seq, dtype=np.int64)])
    rem = np.concatenate([left[order], np.asarray(incoming_remaining, dtype=np.int64)])
    ctx = np.concatenate([run.ctx0[order] + generated[order], incoming_ctx])
    pre = np.concatenate([np.where(admitted[order], 0.0, run.prefill[order]),
                          incoming_ctx if incoming_prefill is None else incoming_prefill])
    return simulate_run(t, seq, rem, ctx, pre, profile, cap)
