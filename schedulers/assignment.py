"""Assignment of prompt groups to generation workers: length-grouped, or round-robin.

A *group* is all ``n_samples`` samples of one prompt; it is never split across workers, so
GRPO's group statistics and prefix sharing stay on one engine.

``assign_by_length`` follows RLHFless's prompt assignment: groups are ranked by predicted
length (longest first) and each worker gets a *contiguous run* of the ranking, so sequences
of similar length share a batch. The run boundaries balance predicted tokens across workers.
Why tokens, and why contiguous:

- Under continuous batching a worker's decode time is ``a * (its longest sequence) +
  c * (its total tokens)`` (see ``throughput.py``). Contiguous runs minimise the first term
  summed over workers: a long sequence keeps only its own worker stepping, instead of one
  long sequence per worker keeping every worker alive (what round-robin does).
- Balancing tokens equalises the second term, so the short-prompt workers take *more* groups
  and finish near the others; the long-prompt workers still run longer by their larger
  ``a * l_max`` term and hold fewer groups. Workers are released as they finish, so early
  finishers cost nothing more; choosing how many workers to pay for is ``scaling.py``'s job.

Episodes that spend time outside the model (environment calls, an agent's own code) hold
their worker longer than their tokens say. ``group_work`` then ranks and balances each
group's predicted seconds per sample instead, its tokens at the decode step's seconds plus
its predicted seconds outside the model, so the groups whose episodes wait long get runs of
their own, spread across workers rather than piled on one; without such seconds it is the
predicted tokens themselves, and the assignment is exactly the length one.

Worker 0 always gets the longest groups, which is where ``scaling.py`` puts already-warm
workers. ``balanced_starts`` evaluates the same split for many worker counts at once; the
scaling policy uses it so that its candidates and the executed assignment agree exactly.
"""

from __future__ import annotations

import numpy as np


def _check_lengths(pred_lengths: np.ndarray, where: str,
                   name: str = "pred_lengths") -> np.ndarray:
    pred = np.asarray(pred_lengths, dtype=np.float64)
    if pred.ndim != 1:
        raise ValueError(f"{where}: {name} has shape {pred.shape}; expected [n_groups]")
    if pred.size and (not np.all(np.isfinite(pred)) or pred.min() < 0):
        bad = int(np.flatnonzero(~np.isfinite(pred) | (pred < 0))[0])
        raise ValueError(
            f"{where}: {name}[{bad}] = {pred[bad]!r}; values must be finite and >= 0"
        )
    return pred


def _check_workers(n_workers: int, where: str) -> int:
    if int(n_workers) != n_workers or n_workers < 1:
        raise ValueError(f"{where}: n_workers={n_workers!r}; allowed: an integer >= 1")
    return int(n_workers)


def group_work(pred_lengths: np.ndarray, pred_env_seconds: np.ndarray | None,
               step_seconds: float) -> np.ndarray:
    """What the assignment ranks and balances, per group: ``pred_lengths`` (response tokens
    per sample) as they are when no episode is predicted any time outside the model
    (``pred_env_seconds`` None or all 0); else each sample's predicted seconds, its tokens
    at ``step_seconds`` a decode step (one token of a sequence) plus its predicted seconds
    outside the model (``LengthPredictor.predict_env``)."""
    pred = _check_lengths(pred_lengths, "group_work")
    if pred_env_seconds is None:
        return pred
    env = _check_lengths(pred_env_seconds, "group_work", "pred_env_seconds")
    if env.shape != pred.shape:
        raise ValueError(f"group_work: pred_env_seconds has shape {env.shape}; expected "
                         f"{pred.shape}, one per group")
    if not env.any():
        return pred
    return pred * step_seconds + env


def length_order(pred_lengths: np.ndarray) -> np.ndarray:
    """Group indices ranked by predicted length, longest first; ties keep input order."""
    return np.argsort(-np.asarray(pred_lengths, dtype=np.float64), kind="stable")


def balanced_starts(prefix_work: np.ndarray, n_workers: np.ndarray) -> np.ndarray:
    """First ranked position of every worker's run, for several worker counts at once.

    ``prefix_work`` is ``[0, w_0, w_0 + w_1, ...]`` (length ``G + 1``, non-decreasing) over
    the ranked groups; ``n_workers`` holds worker counts ``N`` with ``1 <= N <= G``. Returns
    the runs' starts concatenated over the counts (``sum(n_workers)`` entries): for count
    ``N`` they are ``0 = s_0 < s_1 < ... < s_{N-1} < G``, with ``s_k`` the prefix position
    nearest to ``k/N`` of the total work, moved just enough that every run is non-empty.
    """
    prefix = np.asarray(prefix_work, dtype=np.float64)
    ns = np.asarray(n_workers, dtype=np.int64).reshape(-1)
    n_groups = prefix.size - 1
    if ns.size and (ns.min() < 1 or ns.max() > n_groups):
        raise ValueError(
            f"balanced_starts: worker counts {ns.min()}..{ns.max()} for {n_groups} groups; "
            "allowed: 1 <= n_workers <= n_groups"
        )
    if prefix[-1] <= 0:
        prefix = np.arange(n_groups + 1, dtype=np.float64)  # no predicted work: balance counts
    offsets = np.concatenate([[0], np.cumsum(ns)])
    cand = np.repeat(np.arange(ns.size), ns)  # [R] candidate of each row
    k = np.arange(offsets[-1]) - offsets[cand]  # [R] worker index within its candidate
    n = ns[cand]
    target = prefix[-1] * k / n
    hi = np.minimum(np.searchsorted(prefix, target, side="left"), n_groups)
    lo = np.maximum(hi - 1, 0)
    start = np.where(target - prefix[lo] <= prefix[hi] - target, lo, hi)
    # start_k must lie in [k, G - N + k] and strictly increase: shift by k, clip, then take a
    # running max per candidate (the cand * (G + 1) offset keeps candidates from mixing).
    slack = np.clip(start - k, 0, n_groups - n) + cand * (n_groups + 1)
    return np.maximum.accumulate(slack) - cand * (n_groups + 1) + k


def assign_by_length(pred_lengths: np.ndarray, n_workers: int) -> list[np.ndarray]:
    """Split groups into ``n_workers`` contiguous runs of the length ranking, tokens balanced.

    ``pred_lengths``: [n_groups] predicted response tokens per sample of each group (the
    group's work is proportional, all groups having the same ``n_samples``), or each
    sample's predicted seconds where episodes spend time outside the model (``group_work``:
    then the runs are of that ranking, seconds balanced). Returns one
    int64 array of group indices per worker, longest groups on worker 0, each array in
    ranking order. Every group appears exactly once; when ``n_workers > n_groups`` the
    extra workers get empty arrays.
    """
    pred = _check_lengths(pred_lengths, "assign_by_length")
    n = _check_workers(n_workers, "assign_by_length")
    n_groups = pred.size
    used = min(n, n_groups)
    if used == 0:
        return [np.zeros(0, dtype=np.int64) for _ in range(n)]
    order = length_order(pred)
    prefix = np.concatenate([[0.0], np.cumsum(pred[order])])
    starts = balanced_starts(prefix, np.array([used]))
    runs = np.split(order.astype(np.int64), starts[1:])
    return runs + [np.zeros(0, dtype=np.int64) for _ in range(n - used)]


def assign_round_robin(n_groups: int, n_workers: int) -> list[np.ndarray]:
    """Deal groups in input order, group ``g`` to worker ``g % n_workers`` (the baseline)."""
    if int(n_groups) != n_groups or n_groups < 0:
        raise ValueError(f"assign_round_robin: n_groups={n_groups!r}; allowed: an integer >= 0")
    n = _check_workers(n_workers, "assign_round_robin")
    return [np.arange(w, int(n_groups), n, dtype=np.int64) for w in range(n)]
