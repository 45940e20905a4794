"""Adaptive tensor parallelism for the generation tail (PAT): when to merge, to which TP.

In a synchronous RLHF iteration the live decode batch shrinks as responses finish; once few
sequences are left a worker's step is dominated by reading its weights, and a static TP
leaves the node's other GPUs idle or running their own few stragglers. PAT reconfigures in
the middle of generation: the live workers of a node are merged into one worker of a
higher TP (``tp * m`` on the same GPUs), whose step reads ``1/m`` of the weights per GPU.

``plan_tp`` is the decision, pure and predictor-guided: from offline per-TP step profiles
(``Profile.step_seconds`` of each TP: weights read, two all-reduces per layer at the
interconnect's latency and bandwidth, KV reads) and the predicted remaining tokens of every
live sequence, it predicts the time to finish

- *stay*: every live worker decodes its own sequences at the current TP;
- *merge to* ``tp * m`` (m = 2, 4, ... up to the live workers): ``n_live // m`` workers of
  TP ``tp * m`` decode all of them (dealt longest-first, each to the worker that would then
  finish first; the GPUs of any live worker left over are released), after a
  reconfiguration overhead: a fixed part (weights are resharded in place and cached
  communication groups reused, so no weights move) plus each sequence's KV cache, either
  transferred to its new shards over the GPU link or recomputed by a prefill, whichever the
  cost model says is faster;

and scores time and GPU-seconds like ``scaling.py`` (``lam * T / min T + (1 - lam) * C /
min C``; ``lam = 1`` for a pool billed whole anyway). It merges only when the score beats
staying, i.e. when the predicted gain exceeds the overhead.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .profiles import LINK_EFFICIENCY, Profile

RECONFIG_FIXED_S = 0.3  # new communicator from the cache, graph re-capture [assumption]


@dataclass(frozen=True)
class TpChoice:
    """What ``plan_tp`` decided; ``tp == current`` means stay."""

    tp: int
    stay_s: float  # predicted seconds to finish at the current TP
    move_s: float  # predicted seconds at ``tp``, overhead included (= stay_s when staying)
    overhead_s: float
    kv: str  # "transfer", "recompute" or "none"
    reason: str
    groups: tuple[np.ndarray, ...] = ()  # per new worker: positions in the concatenated tails


def finish_seconds(profile: Profile, remaining: np.ndarray, ctx: np.ndarray) -> float:
    """Predicted seconds for one worker to decode sequences with ``remaining`` tokens left
    and ``ctx`` tokens of context each, all live at once: the step model summed over steps
    (``live(s)`` sequences, each one more context token per step)."""
    rem = np.asarray(remaining, dtype=np.float64)
    if rem.size == 0:
        return 0.0
    ctx = np.asarray(ctx, dtype=np.float64)
    steps = float(max(rem.max(), rem.sum() / profile.max_batch))
    ctx_steps = float(np.sum(ctx * rem + rem * (rem - 1) / 2))
    return (profile.step_base_s * steps + profile.step_per_seq_s * float(rem.sum())
            + profile.step_per_ctx_token_s * ctx_steps)


def reconfig_overhead(profile: Profile, target: Profile, ctx_tokens: float,
                      share_moved: float) -> tuple[float, str]:
    """Seconds to reconfigure to ``target``'s TP with ``ctx_tokens`` of live context: the
    fixed part plus the cheaper of moving ``share_moved`` of the KV cache over the GPU link
    and recomputing it all at the target's prefill rate."""
    recompute = ctx_tokens / target.prefill_tokens_per_s
    transfer = float("inf")
    if profile.hardware is not None and profile.kv_bytes_per_token > 0:
        link = profile.hardware.gpu_link_gbs * 1e9 * LINK_EFFICIENCY
        transfer = ctx_tokens * profile.kv_bytes_per_token * share_moved / link
    kv, secs = ("transfer", transfer) if transfer <= recompute else ("recompute", recompute)
    return RECONFIG_FIXED_S + secs, kv


def plan_tp(workers: Sequence[tuple[np.ndarray, np.ndarray]], profiles: Mapping[int, Profile],
            tp: int, *, lambda_cost: float = 1.0) -> TpChoice:
    """Stay at ``tp`` or merge the live ``workers`` (each: predicted remaining tokens and
    context of its live sequences) of one node into fewer workers of a higher TP from
    ``profiles`` (TP -> profile); pure. ``groups`` of the result index the concatenation of
    the workers' sequences. See the module docstring."""
    if tp not in profiles:
        raise ValueError(f"plan_tp: current tp={tp} has no profile; profiles: {sorted(profiles)}")
    if not 0.0 <= lambda_cost <= 1.0:
        raise ValueError(f"plan_tp: lambda_cost={lambda_cost!r}; allowed: [0, 1]")
    live = [(np.asarray(r, float), np.asarray(c, float)) for r, c in workers if len(r)]
    each = [finish_seconds(profiles[tp], r, c) for r, c in live]
    stay_t = max(each, default=0.0)
    stay = TpChoice(tp, stay_t, stay_t, 0.0, "none", "stay")
    if len(live) < 2:
        return stay
    rem = np.concatenate([r for r, _ in live])
    ctx = np.concatenate([c for _, c in live])
    # options: (tp, time, cost in GPU-seconds, overhead, kv, groups)
    options = [(tp, stay_t, tp * float(sum(each)), 0.0, "none", ())]
    m = 2
    while m <= len(live) and tp * m in profiles:
        target, k = profiles[tp * m], len(live) // m
        groups = _deal(target, rem, ctx, k)
        if groups is not None:
            over, kv = reconfig_overhead(profiles[tp], target, float(ctx.sum()), 1 - 1 / m)
            ts = [finish_seconds(target, rem[g], ctx[g]) for g in groups]
            t = over + max(ts)
            options.append((tp * m, t, tp * m * (k * over + sum(ts)), over, kv, groups))
        m *= 2
    t_min = min(o[1] for o in options)
    c_min = min(o[2] for o in options)

    def score(o: tuple) -> float:
        tn = o[1] / t_min if t_min > 0 else 1.0
        cn = o[2] / c_min if c_min > 0 else 1.0
        return lambda_cost * tn + (1 - lambda_cost) * cn

    best = min(options, key=score)
    if best[0] == tp or score(best) >= score(options[0]):
        return stay
    return TpChoice(best[0], stay_t, best[1], best[3], best[4],
                    f"{len(live)} live workers, {rem.size} sequences: tp {tp} -> {best[0]} "
                    f"x {len(best[5])}, predicted {stay_t:.2f} s -> {best[1]:.2f} s "
                    f"({best[4]} KV, overhead {best[3]:.2f} s)", best[5])


def _deal(profile: Profile, rem: np.ndarray, ctx: np.ndarray,
          k: int) -> tuple[np.ndarray, ...] | None:
    """Sequences dealt longest-first over ``k`` workers, each to the one with the least
    predicted work so far; None when a worker's share exceeds its batch cap."""
    picks: list[list[int]] = [[] for _ in range(k)]
    work = (profile.step_base_s * rem + (profile.step_per_seq_s
                                         + profile.step_per_ctx_token_s * ctx) * rem).tolist()
    heap = [(0.0, i) for i in range(k)]  # (predicted work so far, worker)
    for j in np.argsort(-rem, kind="stable").tolist():
        load, i = heapq.heappop(heap)
        picks[i].append(j)
        heapq.heappush(heap, (load + work[j], i))
    cap = profile.batch_cap(float(ctx.mean() + rem.mean()))
    if max(len(p) for p in picks) > cap:
        return None
    return tuple(np.asarray(p, dtype=np.int64) for p in picks)
