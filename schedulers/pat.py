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
  communication groups reused, so no weights move) plus the KV cache of the sequences each
  new worker holds at once, either transferred to its new shards (every GPU over its own
  link, all at once) or recomputed by each new worker's prefill, whichever the cost model
  says is faster. A new worker holds what its KV cache fits (``Profile.batch_cap``, the
  longest first); the rest wait in its queue, as the engine queues what it cannot hold,
  and are recomputed when admitted;

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


def held_count(profile: Profile, remaining: np.ndarray, ctx: np.ndarray) -> int:
    """How many of these sequences (admission order) one worker holds at once: its batch
    cap at their mean final context; the rest wait in its queue."""
    if len(remaining) == 0:
        return 0
    return min(len(remaining), profile.batch_cap(float(np.mean(ctx) + np.mean(remaining))))


def finish_seconds(profile: Profile, remaining: np.ndarray, ctx: np.ndarray) -> float:
    """Predicted seconds for one worker to decode sequences (admission order) with
    ``remaining`` tokens left and ``ctx`` tokens of context each: the step model summed over
    steps (each live sequence one more context token per step), at most ``held_count`` live
    at once, and the prefill of the context of those that wait until admitted."""
    rem = np.asarray(remaining, dtype=np.float64)
    if rem.size == 0:
        return 0.0
    ctx = np.asarray(ctx, dtype=np.float64)
    held = held_count(profile, rem, ctx)
    steps = float(max(rem.max(), rem.sum() / held))
    ctx_steps = float(np.sum(ctx * rem + rem * (rem - 1) / 2))
    return (profile.step_base_s * steps + profile.step_per_seq_s * float(rem.sum())
            + profile.step_per_ctx_token_s * ctx_steps
            + float(ctx[held:].sum()) / profile.prefill_tokens_per_s)


def kv_move_seconds(source: Profile, target: Profile, ctx: np.ndarray, origin: np.ndarray,
                    groups: Sequence[np.ndarray], held: Sequence[int], m: int) -> dict[str, float]:
    """Seconds to bring the KV cache of the sequences each new worker holds (the first
    ``held[j]`` of ``groups[j]``) to their new shards, by each path.

    ``origin``: the live worker (0, 1, ...) each sequence was on; new worker ``j`` runs on
    the GPUs of live workers ``j*m .. j*m+m-1``. A sequence that stays on its worker's GPUs
    keeps ``1/m`` of its KV heads in place and ships the rest; one dealt to another new
    worker ships all of it. Every GPU sends and receives over its own link at the same time
    (NVLink through the NVSwitch; on PCIe, each GPU's own lanes), so *transfer* takes the
    most bytes any old worker's GPUs send or any new worker's GPUs receive, over their links;
    *recompute* is each new worker prefilling its held contexts, all at once."""
    moved_by_origin = np.zeros(int(origin.max()) + 1 if origin.size else 1)
    received, recompute = [], []
    for j, g in enumerate(groups):
        h = np.asarray(g[:held[j]], dtype=np.int64)
        stays = origin[h] // m == j
        moved = ctx[h] * source.kv_bytes_per_token * np.where(stays, 1 - 1 / m, 1.0)
        np.add.at(moved_by_origin, origin[h], moved)
        received.append(float(moved.sum()) / (source.tp * m))
        recompute.append(float(ctx[h].sum()) / target.prefill_tokens_per_s)
    transfer = float("inf")
    if source.hardware is not None and source.kv_bytes_per_token > 0:
        link = source.hardware.gpu_link_gbs * 1e9 * LINK_EFFICIENCY  # one GPU, one direction
        transfer = max(float(moved_by_origin.max()) / source.tp, max(received, default=0.0))
        transfer /= link
    return {"transfer": transfer, "recompute": max(recompute, default=0.0)}


def reconfig_overhead(seconds: Mapping[str, float]) -> tuple[float, str]:
    """The fixed part plus the faster KV path of ``kv_move_seconds``: (seconds, path)."""
    kv = min(seconds, key=lambda k: seconds[k])
    return RECONFIG_FIXED_S + seconds[kv], kv


def plan_tp(workers: Sequence[tuple[np.ndarray, np.ndarray]], profiles: Mapping[int, Profile],
            tp: int, *, lambda_cost: float = 1.0) -> TpChoice:
    """Stay at ``tp`` or merge the live ``workers`` (each: predicted remaining tokens and
    context of its live sequences, admission order) of one node into fewer workers of a
    higher TP from ``profiles`` (TP -> profile); pure. ``groups`` of the result index the
    concatenation of the workers' sequences, each in its new admission order. See the
    module docstring."""
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
    origin = np.concatenate([np.full(len(r), i) for i, (r, _) in enumerate(live)])
    # options: (tp, time, cost in GPU-seconds, overhead, kv, groups)
    options = [(tp, stay_t, tp * float(sum(each)), 0.0, "none", ())]
    m = 2
    while m <= len(live) and tp * m in profiles:
        target, k = profiles[tp * m], len(live) // m
        groups = _deal(target, rem, ctx, k)
        held = [held_count(target, rem[g], ctx[g]) for g in groups]
        over, kv = reconfig_overhead(kv_move_seconds(profiles[tp], target, ctx, origin,
                                                     groups, held, m))
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


def _deal(profile: Profile, rem: np.ndarray, ctx: np.ndarray, k: int) -> tuple[np.ndarray, ...]:
    """Sequences dealt longest-first over ``k`` workers, each to the one with the least
    predicted work so far; each worker's list is in that order (its longest admitted first)."""
    picks: list[list[int]] = [[] for _ in range(k)]
    work = (profile.step_base_s * rem + (profile.step_per_seq_s
                                         + profile.step_per_ctx_token_s * ctx) * rem).tolist()
    heap = [(0.0, i) for i in range(k)]  # (predicted work so far, worker)
    for j in np.argsort(-rem, kind="stable").tolist():
        load, i = heapq.heappop(heap)
        picks[i].append(j)
        heapq.heappush(heap, (load + work[j], i))
    return tuple(np.asarray(p, dtype=np.int64) for p in picks)
