"""Cost-aware choice of the number of generation workers for one iteration (RLHFless AS).

For every candidate count ``N`` the policy assigns the prompt groups to ``N`` workers, predicts
each worker's seconds ``T_i`` from the throughput model (prefill + decode, plus a cold start
for every worker beyond the ``keep_warm`` ones already running), and scores

    T(N) = max_i T_i                 iteration time: the last worker to finish
    C(N) = sum_i T_i                 worker-seconds billed: each worker released when done
    score(N) = lam * T(N) / min_M T(M) + (1 - lam) * C(N) / min_M C(M)

and picks the lowest score (ties go to the smaller ``N``). With ``fixed_seconds`` and
``fixed_cost_ws`` (the reward + update that follow generation, the same for every ``N``) the
score is over the whole step: ``T(N) + fixed_seconds`` and ``C(N) + fixed_cost_ws``, so a
generation speed-up is weighed by what it does to the step, not to generation alone.
``lam = 1`` is the fastest count, ``lam = 0`` the cheapest; in between lie RLHFless's
"sweet spots". C(N) is in worker-seconds; multiply by a pool's price per worker-second for
money (the normalisation makes the choice independent of price).

With the default ``assign_by_length`` every candidate is evaluated at once from prefix sums
over the length ranking (``assignment.balanced_starts``): no per-candidate Python loop, a
few milliseconds for 1,024 groups and 160 candidates. Any other ``assign`` callable is
evaluated candidate by candidate.

Warm workers take the first runs of the assignment (the longest groups), since they can start
at once and the cold ones need their cold start before their (shorter) runs. Prefill counts
each group's prompt once: the samples of a group share its prefix.

Given each group's predicted seconds outside the model (``pred_env_seconds``: environment
calls, an agent's own code), the assignment ranks and balances each sample's predicted
seconds (``assignment.group_work``, a token at one decode step of the group's own batch)
instead of its tokens; the workers' predicted seconds are still their tokens' and prompts'
plus the throughput model's wait on environments, once per busy worker, and its fetch of the
iteration's policy version (``weight_fetch_s``), also once per busy worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .assignment import (
    assign_by_length,
    assign_round_robin,
    balanced_starts,
    group_work,
    length_order,
)
from .throughput import ThroughputModel

Assign = Callable[[np.ndarray, int], list[np.ndarray]]


def round_robin(pred_lengths: np.ndarray, n_workers: int) -> list[np.ndarray]:
    """``assign_round_robin`` with the ``Assign`` signature, for comparisons."""
    return assign_round_robin(len(pred_lengths), n_workers)


@dataclass(frozen=True, eq=False)
class ScalingDecision:
    """One scaling decision: the chosen count, its predictions and every candidate's score."""

    n_workers: int
    predicted_seconds: float  # T(N) of the chosen N
    predicted_cost_ws: float  # C(N) of the chosen N, worker-seconds
    lambda_cost: float  # weight of time in the score (1 - weight of cost)
    keep_warm: int
    n_groups: int
    n_samples: int
    candidates: np.ndarray  # [K] worker counts considered
    time_s: np.ndarray  # [K] T(N)
    cost_ws: np.ndarray  # [K] C(N)
    score: np.ndarray  # [K]
    worker_seconds: np.ndarray  # [n_workers] predicted T_i of the chosen N, cold start included
    assignment: tuple[np.ndarray, ...]  # [n_workers] group indices per worker
    model: dict[str, Any] = field(default_factory=dict)  # throughput fit used

    def table(self) -> list[dict[str, float]]:
        """One row per candidate: n_workers, time_s, cost_ws, score."""
        return [
            {"n_workers": int(n), "time_s": float(t), "cost_ws": float(c), "score": float(s)}
            for n, t, c, s in zip(
                self.candidates, self.time_s, self.cost_ws, self.score, strict=True
            )
        ]

    def to_record(self, with_assignment: bool = True) -> dict[str, Any]:
        """JSON-able record for the run directory's decision log."""
        record: dict[str, Any] = {
            "n_workers": self.n_workers,
            "predicted_seconds": self.predicted_seconds,
            "predicted_cost_ws": self.predicted_cost_ws,
            "lambda_cost": self.lambda_cost,
            "keep_warm": self.keep_warm,
            "n_groups": self.n_groups,
            "n_samples": self.n_samples,
            "worker_seconds": self.worker_seconds.tolist(),
            "candidates": self.table(),
            "model": dict(self.model),
        }
        if with_assignment:
            record["assignment"] = [a.tolist() for a in self.assignment]
        return record


def _check(name: str, ok: bool, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"choose_generation_workers: {name}={value!r}; allowed: {allowed}")


def _per_group(name: str, values: np.ndarray | float | None, n_groups: int) -> np.ndarray:
    arr = np.zeros(n_groups) if values is None else np.asarray(values, dtype=np.float64)
    arr = np.broadcast_to(arr, (n_groups,)) if arr.ndim == 0 else arr
    if arr.shape != (n_groups,) or not np.all(np.isfinite(arr)) or (arr.size and arr.min() < 0):
        raise ValueError(
            f"choose_generation_workers: {name} must be a finite scalar >= 0 or an array of "
            f"shape [{n_groups}] (one per group); got shape {np.shape(arr)}"
        )
    return arr


def _rows_by_length(
    pred: np.ndarray, work: np.ndarray, pmax: np.ndarray, ptok: np.ndarray, ns: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per (candidate, worker) row: max length, sum of lengths, prompt tokens; plus each row's
    run start and the ranking by ``work`` (``group_work``). All candidates at once from prefix
    sums over the ranking."""
    n_groups = pred.size
    order = length_order(work)
    prefix = np.concatenate([[0.0], np.cumsum(pred[order])])
    prefix_ptok = np.concatenate([[0.0], np.cumsum(ptok[order])])
    prefix_work = np.concatenate([[0.0], np.cumsum(work[order])])
    starts = balanced_starts(prefix_work, ns)  # [R]
    last = np.cumsum(ns) - 1  # row of each candidate's last worker
    ends = np.empty_like(starts)
    ends[:-1] = starts[1:]
    ends[last] = n_groups
    pmax_sorted = pmax[order]
    max_len = np.maximum.reduceat(pmax_sorted, starts)
    # reduceat is only right where the next row starts later; a last row runs to the end
    max_len[last] = np.maximum.accumulate(pmax_sorted[::-1])[::-1][starts[last]]
    sum_len = prefix[ends] - prefix[starts]
    return max_len, sum_len, prefix_ptok[ends] - prefix_ptok[starts], starts, order


def _rows_generic(
    pred: np.ndarray, work: np.ndarray, pmax: np.ndarray, ptok: np.ndarray, ns: np.ndarray,
    assign: Assign
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[list[np.ndarray]]]:
    """The same rows by calling ``assign(work, n)`` for each candidate; checks each is a
    partition."""
    n_groups = pred.size
    maxes, sums, ptoks, plans = [], [], [], []
    for n in ns:
        runs = [np.asarray(r, dtype=np.int64) for r in assign(work, int(n))]
        flat = np.concatenate(runs) if runs else np.zeros(0, dtype=np.int64)
        if len(runs) != n or flat.size != n_groups or np.any(
            np.bincount(flat, minlength=n_groups) != 1
        ):
            raise ValueError(
                f"choose_generation_workers: assign(pred_lengths, {n}) must return {n} arrays "
                f"that together hold each of the {n_groups} group indices exactly once"
            )
        worker = np.repeat(np.arange(n), [r.size for r in runs])
        mx = np.zeros(n)
        np.maximum.at(mx, worker, pmax[flat])
        maxes.append(mx)
        sums.append(np.bincount(worker, weights=pred[flat], minlength=n))
        ptoks.append(np.bincount(worker, weights=ptok[flat], minlength=n))
        plans.append(runs)
    return np.concatenate(maxes), np.concatenate(sums), np.concatenate(ptoks), plans


def choose_generation_workers(
    pred_lengths: np.ndarray,
    n_samples: int,
    model: ThroughputModel,
    *,
    max_workers: int,
    lambda_cost: float,
    min_workers: int = 1,
    keep_warm: int = 0,
    assign: Assign = assign_by_length,
    pred_max_lengths: np.ndarray | None = None,
    prompt_tokens: np.ndarray | float | None = None,
    fixed_seconds: float = 0.0,
    fixed_cost_ws: float = 0.0,
    pred_env_seconds: np.ndarray | None = None,
) -> ScalingDecision:
    """Choose how many generation workers to run this iteration, and what each one gets.

    Called once per iteration before generation. ``pred_lengths``: [n_groups] predicted mean
    response tokens per sample (``LengthPredictor.predict``); ``pred_max_lengths``: [n_groups]
    predicted longest sample (``predict_max``; defaults to ``pred_lengths``, and is raised to
    at least it); ``prompt_tokens``: prompt tokens of each group, prefilled once per group
    (scalar or [n_groups]; default 0); ``pred_env_seconds``: [n_groups] predicted seconds
    outside the model of each of the group's episodes (``predict_env``; None or all 0: the
    assignment is by tokens alone). Candidates are ``min_workers..max_workers``, capped at
    ``n_groups`` since a group is never split. ``keep_warm`` workers are already running and
    pay no cold start. ``assign(work, n) -> list of n index arrays`` must partition the
    groups (``work``: ``group_work``, ``pred_lengths`` itself without seconds outside the
    model). ``fixed_seconds`` / ``fixed_cost_ws``: the rest of the step (update), added
    to every candidate's time and cost before scoring (0: generation alone). Pure: reads
    ``model``, changes nothing.
    """
    pred = np.asarray(pred_lengths, dtype=np.float64)
    _check("pred_lengths.shape", pred.ndim == 1 and pred.size > 0, pred.shape, "[n_groups >= 1]")
    n_groups = pred.size
    pred = _per_group("pred_lengths", pred, n_groups)
    pmax = np.maximum(_per_group("pred_max_lengths", pred_max_lengths, n_groups), pred)
    ptok = _per_group("prompt_tokens", prompt_tokens, n_groups)
    _check("n_samples", int(n_samples) == n_samples and n_samples >= 1, n_samples, "integer >= 1")
    _check("lambda_cost", 0.0 <= lambda_cost <= 1.0, lambda_cost, "0 <= lambda_cost <= 1")
    _check("min_workers", int(min_workers) == min_workers and min_workers >= 1, min_workers, ">= 1")
    _check("max_workers", int(max_workers) == max_workers and max_workers >= min_workers,
           max_workers, f"an integer >= min_workers ({min_workers})")
    _check("keep_warm", int(keep_warm) == keep_warm and keep_warm >= 0, keep_warm, "integer >= 0")
    for key, val in (("fixed_seconds", fixed_seconds), ("fixed_cost_ws", fixed_cost_ws)):
        _check(key, bool(np.isfinite(val)) and val >= 0, val, "a finite number >= 0")

    work = group_work(pred, pred_env_seconds, float(model.t_step(n_samples)))
    hi = min(int(max_workers), n_groups)
    ns = np.arange(min(int(min_workers), hi), hi + 1)  # [K]
    if assign is assign_by_length:
        max_len, sum_len, ptoks, starts, order = _rows_by_length(pred, work, pmax, ptok, ns)
        plans = None
    else:
        max_len, sum_len, ptoks, plans = _rows_generic(pred, work, pmax, ptok, ns, assign)
    offsets = np.concatenate([[0], np.cumsum(ns)])
    k = np.arange(offsets[-1]) - np.repeat(offsets[:-1], ns)  # [R] worker index in candidate
    busy = (sum_len > 0) | (ptoks > 0) | (max_len > 0)
    cold = np.where((k >= keep_warm) & busy, model.cold_start_s, 0.0)
    # every busy worker fetches the iteration's version and waits on its agents
    t_row = np.where(busy, model.worker_seconds(max_len, n_samples * sum_len, ptoks)
                     + model.env_wait_s + model.weight_fetch_s, 0.0) + cold
    time_s = np.maximum.reduceat(t_row, offsets[:-1])
    cost_ws = np.add.reduceat(t_row, offsets[:-1])
    step_t, step_c = time_s + fixed_seconds, cost_ws + fixed_cost_ws
    t_norm = step_t / step_t.min() if step_t.min() > 0 else np.ones_like(step_t)
    c_norm = step_c / step_c.min() if step_c.min() > 0 else np.ones_like(step_c)
    score = lambda_cost * t_norm + (1.0 - lambda_cost) * c_norm
    best = int(np.argmin(score))
    n_best = int(ns[best])
    if plans is None:
        chosen = np.split(order.astype(np.int64), starts[offsets[best] + 1 : offsets[best + 1]])
    else:
        chosen = plans[best]
    return ScalingDecision(
        n_workers=n_best,
        predicted_seconds=float(time_s[best]),
        predicted_cost_ws=float(cost_ws[best]),
        lambda_cost=float(lambda_cost),
        keep_warm=int(keep_warm),
        n_groups=n_groups,
        n_samples=int(n_samples),
        candidates=ns,
        time_s=time_s,
        cost_ws=cost_ws,
        score=score,
        worker_seconds=t_row[offsets[best] : offsets[best + 1]],
        assignment=tuple(chosen),
        model=model.to_record(),
    )
