"""A ``Profile`` fitted from one of our own recorded runs (the tiny CPU run: a "GPU" is then
a Dask worker process), for calibration and for scenarios with ``fit_run``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..profiles import Profile
from .workloads import Batch, replay_trace


def _lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray | None:
    """Least squares, or None when a coefficient comes out negative."""
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return coef if np.all(coef >= 0) else None


def _fit_subset(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative linear fit of ``y`` on some columns of ``x``.

    Every subset of columns (there are few) whose fit is non-negative is scored by its
    leave-one-out mean relative error, so that a handful of noisy timings does not buy a
    parameter per point; the best subset is then refitted once without the points whose
    residual lies beyond 3 scaled MADs (a timing another process on the machine stretched).
    """
    n, m = x.shape
    best_cols, best_err = [0], np.inf
    for mask in range(1, 2**m):
        cols = [j for j in range(m) if mask >> j & 1]
        if len(cols) >= n or _lstsq(x[:, cols], y) is None:
            continue
        errs = []
        for i in range(n):
            keep = np.arange(n) != i
            coef = _lstsq(x[keep][:, cols], y[keep])
            pred = np.inf if coef is None else float(x[i, cols] @ coef)
            errs.append(abs(pred - y[i]) / max(abs(y[i]), 1e-12))
        if np.mean(errs) < best_err:
            best_cols, best_err = cols, float(np.mean(errs))
    coef = _lstsq(x[:, best_cols], y)
    coef = np.zeros(len(best_cols)) if coef is None else coef
    res = y - x[:, best_cols] @ coef
    dev = np.abs(res - np.median(res))
    mad = 1.4826 * np.median(dev)
    keep = dev <= 3 * mad if mad > 0 else np.ones(n, dtype=bool)
    if keep.sum() > len(best_cols) + 1:
        refit = _lstsq(x[keep][:, best_cols], y[keep])
        coef = coef if refit is None else refit
    out = np.zeros(m)
    out[best_cols] = coef
    return out


def shard_features(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    """Per logged worker of a replayed batch: (decode steps, decode tokens, context-token
    steps, prefill tokens), the quantities the step model multiplies; and the worker index.

    Context-token steps sum, over the worker's sequences, the context they hold at every
    step (prompt p, then one more per generated token): ``p*l + l*(l-1)/2``. Prefill counts
    each group's prompt once and the batch's shared prefix once per worker (prefix dedup)."""
    workers = np.unique(batch.workers)
    rows = []
    for w in workers:
        g = batch.workers == w
        lengths = batch.lengths[g].astype(np.float64)  # [groups, n_samples]
        p = batch.prompt_tokens[g].astype(np.float64)[:, None]
        ctx = float(np.sum(p * lengths + lengths * (lengths - 1) / 2))
        pre = float(np.sum(p - batch.shared_prefix_tokens) + batch.shared_prefix_tokens)
        rows.append((lengths.max(), lengths.sum(), ctx, pre))
    return np.array(rows), workers


def profile_from_run(run_dir: str | Path, fit_iterations: list[int] | None = None,
                     name: str | None = None) -> Profile:
    """Fit a ``Profile`` to a recorded run (``metrics.jsonl`` + ``rollouts/``).

    ``fit_iterations`` selects the iterations to fit on (default: all but the first, whose
    first update and engine calls warm up). Fitted:

    - the decode step model and prefill rate: a non-negative linear fit of each worker's
      ``gen_end - gen_start`` on ``shard_features`` (terms chosen by leave-one-out error,
      see ``_fit_subset``);
    - ``sync_s``: the median of ``generate_wall_s`` minus the longest shard (weight fetch
      and task overhead);
    - update seconds as ``overhead + tokens / rate`` (prompt + response tokens), fitted
      the same way;
    - ``iteration_overhead_s``: the median of the iteration's cycle (end of the previous
      iteration to its end, else ``iteration_s``) minus ``generate_wall_s`` and
      ``update_wall_s``: dedup, shard, reward, advantage, publish, scheduling, and writing
      the rollouts and metrics between iterations.

    Worker processes stand in for GPUs (``tp`` 1); there is no engine batch cap (a shard
    decodes all its sequences at once); cold starts are 0 because the run's workers were
    already warm when its iterations began."""
    trace = replay_trace(run_dir)
    chosen = [i for i, b in enumerate(trace.batches)
              if (b.iteration in fit_iterations if fit_iterations is not None
                  else b.iteration != trace.batches[0].iteration)]
    if not chosen:
        raise ValueError(f"profile_from_run({run_dir}): no iterations to fit; the run has "
                         f"{[b.iteration for b in trace.batches]}, asked {fit_iterations}")
    need = ("generate_wall_s", "update_wall_s", "iteration_s")
    for i in chosen:
        missing = [k for k in need if k not in trace.measured[i]]
        if missing:
            raise ValueError(f"profile_from_run({run_dir}): iteration "
                             f"{trace.batches[i].iteration} lacks metrics {missing}")
    ends = {m["iteration"]: m["time"] for m in trace.measured if "time" in m}
    feats, secs, sync, upd_x, upd_y, over = [], [], [], [], [], []
    for i in chosen:
        b, m = trace.batches[i], trace.measured[i]
        f, workers = shard_features(b)
        shard_s = np.asarray(m["shard_gen_s"])[workers]
        feats.append(f)
        secs.append(shard_s)
        sync.append(m["generate_wall_s"] - shard_s.max())
        upd_x.append(float(b.lengths.sum() + b.n_samples * b.prompt_tokens.sum()))
        upd_y.append(m["update_wall_s"])
        cycle = m["time"] - ends[b.iteration - 1] if b.iteration - 1 in ends else m["iteration_s"]
        over.append(cycle - m["generate_wall_s"] - m["update_wall_s"])
    a, c, k, inv_rate = _fit_subset(np.concatenate(feats), np.concatenate(secs))
    u0, inv_upd = _fit_subset(np.column_stack([np.ones(len(upd_x)), upd_x]),
                              np.asarray(upd_y))
    big = 10**9
    return Profile(
        name=name or f"fitted:{Path(run_dir).name}",
        tp=1,
        step_base_s=float(a),
        step_per_seq_s=float(c),
        step_per_ctx_token_s=float(k),
        prefill_tokens_per_s=float(1.0 / inv_rate) if inv_rate > 0 else float(big),
        max_batch=big,
        kv_capacity_tokens=big,
        update_tokens_per_s_per_gpu=float(1.0 / inv_upd) if inv_upd > 0 else float(big),
        update_overhead_s=float(u0),
        sync_s=max(float(np.median(sync)), 0.0),
        iteration_overhead_s=max(float(np.median(over)), 0.0),
        price_per_gpu_s=1.0,
    )
