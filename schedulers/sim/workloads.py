"""Workload traces for the simulator: synthetic response lengths, or a replayed run.

A ``Trace`` is a list of ``Batch``es, one per iteration: the prompt ids of the batch, their
prompt lengths, and the response length of every (prompt, sample). The simulator only needs
lengths, so a trace is the whole "generated content" a policy is run against, identical
across the policies being compared (RLHFless's trace-replay baseline does the same).

``synthetic_trace`` draws lengths as follows (papers.md §7):

- per prompt, a latent log-normal mean: ``log m_p = log p50 + s_p * z_p``; within a group,
  ``log l = log m_p + s_w * e`` with ``s_w = sqrt(log(1 + group_cv**2))``, so that the
  pooled sample lengths have median ``response_p50`` and 99th percentile ``response_p99``;
- across epochs ``z_p`` follows a stationary AR(1) whose coefficient is chosen so that the
  fraction of per-prompt mean-length changes under 50 tokens is ``drift_under_50`` (RLHFless
  reports about 70 %); if group sampling noise alone already exceeds the target, there is no
  drift (check with ``drift_stats``);
- an optional global trend multiplies lengths by ``trend_per_epoch`` every epoch;
- a fraction ``long_prompt_frac`` of the prompts run long *persistently* (every epoch): their
  latent mean is ``long_prompt_factor`` times larger, so the same few prompts make the tail
  again and again, as in real runs;
- a truncation mass: each sample runs to the cap with probability ``clip_ratio`` (the clip
  ratio verl logs), on top of the draws that exceed the cap by themselves;
- lengths are rounded, at least 1 and at most ``max_response_tokens`` (the cap).

Prompts are drawn like the training loop's sampler: a seeded permutation of the dataset per
epoch, batches running across epoch boundaries. ``replay_trace`` turns a run directory
(``metrics.jsonl`` + ``rollouts/iter-N.parquet``) into a trace, keeping the worker that
generated each group, the measured stage seconds and each worker's generation seconds
(``gen_end - gen_start`` of its shard) for calibration.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

Z99 = 2.3263478740408408  # standard normal 99th percentile


@dataclass(frozen=True, eq=False)
class Batch:
    """One iteration's prompts and the response lengths they will get."""

    iteration: int
    prompt_ids: np.ndarray  # [G] str
    prompt_tokens: np.ndarray  # [G] int
    lengths: np.ndarray  # [G, n_samples] response tokens
    shared_prefix_tokens: int = 0  # leading tokens common to every prompt of the batch
    workers: np.ndarray | None = None  # [G] worker that generated each group (replay only)

    @property
    def n_groups(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def n_samples(self) -> int:
        return int(self.lengths.shape[1])


@dataclass(frozen=True, eq=False)
class Trace:
    name: str
    batches: list[Batch]
    n_samples: int
    max_response_tokens: int
    measured: list[dict[str, Any]] = field(default_factory=list)  # replay: metrics per batch
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.batches)

    def head(self, n: int) -> Trace:
        return dataclasses.replace(self, batches=self.batches[:n], measured=self.measured[:n])

    def select(self, iterations: list[int]) -> Trace:
        """The batches of the given iterations (and their measurements), in trace order."""
        keep = [i for i, b in enumerate(self.batches) if b.iteration in set(iterations)]
        return dataclasses.replace(
            self, batches=[self.batches[i] for i in keep],
            measured=[self.measured[i] for i in keep] if self.measured else [])


@dataclass(frozen=True)
class WorkloadConfig:
    """Parameters of ``synthetic_trace``; the presets are ``GSM8K`` and ``REASONING``."""

    name: str = "gsm8k"
    dataset_prompts: int = 7473  # GSM8K train split size
    batch_prompts: int = 1024
    n_samples: int = 8
    iterations: int = 22  # 3 epochs of GSM8K at 1,024 prompts per batch
    response_p50: float = 220.0
    response_p99: float = 800.0
    group_cv: float = 0.3  # spread of lengths within one prompt's group
    drift_under_50: float = 0.7  # target fraction of per-prompt changes < 50 tokens
    trend_per_epoch: float = 1.0
    max_response_tokens: int = 2048
    prompt_p50: float = 180.0
    prompt_p99: float = 400.0
    max_prompt_tokens: int = 1024
    shared_prefix_tokens: int = 0  # e.g. a system prompt or few-shot template
    long_prompt_frac: float = 0.0  # prompts with a persistent tendency to run long
    long_prompt_factor: float = 1.0  # how much longer their responses are
    clip_ratio: float = 0.0  # probability that a sample runs to the cap (truncated)
    seed: int = 0

    def __post_init__(self) -> None:
        where = f"WorkloadConfig({self.name!r})"
        for key in ("dataset_prompts", "batch_prompts", "n_samples", "iterations",
                    "max_response_tokens", "max_prompt_tokens"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"{where}: {key}={getattr(self, key)!r}; allowed: >= 1")
        if not 0 < self.response_p50 < self.response_p99:
            raise ValueError(f"{where}: need 0 < response_p50 < response_p99")
        if not 0 < self.prompt_p50 <= self.prompt_p99:
            raise ValueError(f"{where}: need 0 < prompt_p50 <= prompt_p99")
        if not (self.group_cv >= 0 and 0 < self.drift_under_50 <= 1 and self.trend_per_epoch > 0):
            raise ValueError(f"{where}: need group_cv >= 0, 0 < drift_under_50 <= 1, "
                             "trend_per_epoch > 0")
        if not (0 <= self.long_prompt_frac <= 1 and self.long_prompt_factor >= 1
                and 0 <= self.clip_ratio <= 1):
            raise ValueError(f"{where}: need 0 <= long_prompt_frac <= 1, long_prompt_factor "
                             ">= 1 and 0 <= clip_ratio <= 1")

    def to_record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# GSM8K GRPO (verl logs, research notes): 7B runs clip <= 0.2 % at a 1,024 cap; a few
# prompts run long every epoch (2 % at 2.5x: [assumption], the shape the issue describes).
GSM8K = WorkloadConfig(long_prompt_frac=0.02, long_prompt_factor=2.5, clip_ratio=0.002)
REASONING = WorkloadConfig(name="reasoning", dataset_prompts=40315, response_p50=500.0,
                           response_p99=5000.0, group_cv=0.3, max_response_tokens=8192,
                           prompt_p50=120.0, prompt_p99=600.0)
# Long chain-of-thought, DeepScaleR-like (PAT's workload): 8K cap, average response 3.5-5.5K
# in DeepScaleR's 8K phase (p50 2,800 and p99 12,000 before the cap: ~5 % truncated), 128
# prompts x 8 samples; a 1,024-prompt subset so that three epochs fit in 24 iterations.
LONG_COT = WorkloadConfig(name="long-cot", dataset_prompts=1024, batch_prompts=128,
                          iterations=24, response_p50=2800.0, response_p99=12000.0,
                          max_response_tokens=8192, prompt_p50=120.0, prompt_p99=400.0,
                          long_prompt_frac=0.02, long_prompt_factor=1.5, clip_ratio=0.01)
WORKLOADS = {"gsm8k": GSM8K, "reasoning": REASONING, "long-cot": LONG_COT}  # by name


def _sigmas(cfg: WorkloadConfig) -> tuple[float, float]:
    """(prompt-level, within-group) sigma of log length; pooled sigma matches p50/p99."""
    total = np.log(cfg.response_p99 / cfg.response_p50) / Z99
    within = min(np.sqrt(np.log1p(cfg.group_cv**2)), total)
    return float(np.sqrt(total**2 - within**2)), float(within)


def _group_means(cfg: WorkloadConfig, z: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    s_p, s_w = _sigmas(cfg)
    mu = np.log(cfg.response_p50) + s_p * z
    draws = np.exp(mu[:, None] + s_w * rng.standard_normal((z.size, cfg.n_samples)))
    return np.clip(np.rint(draws), 1, cfg.max_response_tokens).mean(axis=1)


def _fit_rho(cfg: WorkloadConfig, n: int = 4000) -> float:
    """AR(1) coefficient giving ``drift_under_50`` of per-prompt changes under 50 tokens."""
    rng = np.random.default_rng([cfg.seed, 7])
    z0, eps = rng.standard_normal(n), rng.standard_normal(n)

    def under(rho: float) -> float:
        z1 = rho * z0 + np.sqrt(1 - rho * rho) * eps
        r = np.random.default_rng([cfg.seed, 8])
        return float(np.mean(np.abs(_group_means(cfg, z1, r) - _group_means(cfg, z0, r)) < 50))

    if under(1.0) <= cfg.drift_under_50:
        return 1.0  # sampling noise alone already moves prompts this much: no drift
    lo, hi = 0.0, 1.0
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if under(mid) < cfg.drift_under_50 else (lo, mid)
    return 0.5 * (lo + hi)


def synthetic_trace(cfg: WorkloadConfig) -> Trace:
    """A trace of ``cfg.iterations`` batches drawn as the module docstring describes."""
    rng = np.random.default_rng(cfg.seed)
    s_p, s_w = _sigmas(cfg)
    rho = _fit_rho(cfg)
    n_epochs = (cfg.iterations * cfg.batch_prompts) // cfg.dataset_prompts + 2
    z = np.empty((n_epochs, cfg.dataset_prompts))
    z[0] = rng.standard_normal(cfg.dataset_prompts)
    for e in range(1, n_epochs):
        z[e] = rho * z[e - 1] + np.sqrt(1 - rho * rho) * rng.standard_normal(cfg.dataset_prompts)
    s_prompt = np.log(cfg.prompt_p99 / cfg.prompt_p50) / Z99
    prompt_len = np.clip(np.rint(cfg.prompt_p50 * np.exp(s_prompt * rng.standard_normal(
        cfg.dataset_prompts))), max(cfg.shared_prefix_tokens, 1), cfg.max_prompt_tokens)
    ids = np.array([f"p{i}" for i in range(cfg.dataset_prompts)])
    long = np.where(rng.random(cfg.dataset_prompts) < cfg.long_prompt_frac,
                    np.log(cfg.long_prompt_factor), 0.0)  # persistent, per prompt
    batches, position = [], 0
    for it in range(1, cfg.iterations + 1):
        rows, epochs = [], []
        while len(rows) < cfg.batch_prompts:
            epoch, offset = divmod(position, cfg.dataset_prompts)
            order = np.random.default_rng([cfg.seed, epoch]).permutation(cfg.dataset_prompts)
            take = min(cfg.batch_prompts - len(rows), cfg.dataset_prompts - offset)
            rows.extend(order[offset:offset + take].tolist())
            epochs.extend([epoch] * take)
            position += take
        rows_a, ep = np.asarray(rows), np.asarray(epochs)
        mu = (np.log(cfg.response_p50) + s_p * z[ep, rows_a]
              + ep * np.log(cfg.trend_per_epoch) + long[rows_a])
        draws = np.exp(mu[:, None] + s_w * rng.standard_normal((rows_a.size, cfg.n_samples)))
        draws[rng.random(draws.shape) < cfg.clip_ratio] = cfg.max_response_tokens
        lengths = np.clip(np.rint(draws), 1, cfg.max_response_tokens).astype(np.int64)
        batches.append(Batch(it, ids[rows_a], prompt_len[rows_a].astype(np.int64), lengths,
                             cfg.shared_prefix_tokens))
    return Trace(cfg.name, batches, cfg.n_samples, cfg.max_response_tokens,
                 meta={"workload": cfg.to_record(), "drift_rho": rho})


def drift_stats(trace: Trace) -> dict[str, float]:
    """Per-prompt change of mean response length between consecutive appearances: the
    fraction under 50 tokens, and pooled sample-length p50 / p99 / max and the fraction of
    samples at the cap."""
    last: dict[str, float] = {}
    changes = []
    for b in trace.batches:
        means = b.lengths.mean(axis=1)
        for pid, m in zip(b.prompt_ids.tolist(), means.tolist(), strict=True):
            if pid in last:
                changes.append(abs(m - last[pid]))
            last[pid] = m
    pooled = np.concatenate([b.lengths.ravel() for b in trace.batches])
    ch = np.asarray(changes)
    cap = trace.max_response_tokens
    return {
        "frac_change_under_50": float(np.mean(ch < 50)) if ch.size else float("nan"),
        "n_changes": int(ch.size),
        "p50": float(np.percentile(pooled, 50)),
        "p99": float(np.percentile(pooled, 99)),
        "max": float(pooled.max()),
        "clip_ratio": float(np.mean(pooled >= cap)),
    }


def _common_prefix(rows: list[list[int]]) -> int:
    if not rows:
        return 0
    first, n = rows[0], min(len(r) for r in rows)
    for r in rows[1:]:
        k = 0
        while k < n and r[k] == first[k]:
            k += 1
        n = k
    return n


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Records of ``metrics.jsonl`` in a run directory, in file order."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no metrics.jsonl; is {run_dir} a run directory?")
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def replay_trace(run_dir: str | Path) -> Trace:
    """The trace of a recorded run: one batch per ``rollouts/iter-N.parquet``, groups in the
    log's order, with each group's worker and the iteration's measured metrics."""
    run = Path(run_dir)
    files = sorted((run / "rollouts").glob("iter-*.parquet"))
    if not files:
        raise FileNotFoundError(f"{run / 'rollouts'}: no iter-*.parquet files to replay")
    metrics = {m["iteration"]: m for m in read_metrics(run) if m.get("event") == "iteration"}
    batches, measured, n_samples, cap = [], [], None, 0
    for path in files:
        it = int(path.stem.split("-")[1])
        t = pq.read_table(path, columns=["prompt_id", "prompt_ids", "sample_idx",
                                         "response_ids", "worker", "gen_start", "gen_end"])
        pid = np.asarray(t.column("prompt_id").to_pylist(), dtype=str)
        keys, first, inverse, counts = np.unique(pid, return_index=True, return_inverse=True,
                                                 return_counts=True)
        if counts.min() != counts.max():
            raise ValueError(f"{path}: groups of unequal size {sorted(set(counts.tolist()))}; "
                             "every prompt must have the same number of samples")
        n = int(counts[0])
        if n_samples not in (None, n):
            raise ValueError(f"{path}: {n} samples per prompt, earlier files had {n_samples}")
        n_samples = n
        order = np.argsort(first, kind="stable")  # groups in the log's order
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        g = rank[inverse]
        s = np.asarray(t.column("sample_idx").to_numpy(), dtype=np.int64)
        resp = pc.list_value_length(t.column("response_ids")).to_numpy(zero_copy_only=False)
        lengths = np.zeros((keys.size, n), dtype=np.int64)
        lengths[g, s] = np.maximum(resp, 1)
        prompts = t.column("prompt_ids").to_pylist()
        ptok = np.zeros(keys.size, dtype=np.int64)
        ptok[g] = [len(p) for p in prompts]
        names, w_index = np.unique(np.asarray(t.column("worker").to_pylist(), dtype=str),
                                   return_inverse=True)
        workers = np.zeros(keys.size, dtype=np.int64)
        workers[g] = w_index
        shared = _common_prefix([prompts[i] for i in first])
        batches.append(Batch(it, keys[order], ptok, lengths, shared, workers))
        start = np.asarray(t.column("gen_start").to_numpy(), dtype=np.float64)
        end = np.asarray(t.column("gen_end").to_numpy(), dtype=np.float64)
        shard_s = [float(end[w_index == w].max() - start[w_index == w].min())
                   for w in range(names.size)]
        measured.append({**metrics.get(it, {}), "worker_names": names.tolist(),
                         "shard_gen_s": shard_s})
        cap = max(cap, int(lengths.max()))
    config_path = run / "config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    return Trace(f"replay:{run.name}", batches, int(n_samples), int(
        config.get("max_new_tokens", cap)), measured, meta={"config": config})
