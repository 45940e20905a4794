"""Hardware × model profiles for the simulator, as data, plus a profile fitted from a real run.

A ``Profile`` holds what the simulator needs to time one RLHF iteration on a pool of GPUs:

- decode step of one generation worker (a tensor-parallel group of ``tp`` GPUs)::

      t_step = step_base_s + step_per_seq_s * live_sequences + step_per_ctx_token_s * ctx_tokens

  where ``ctx_tokens`` sums the context (prompt + generated) of the live sequences: the
  weights are read once per step (base), each sequence costs compute (per seq), and each
  context token's KV is read once per step (per ctx token);
- prefill rate, engine batch cap and KV capacity of a worker;
- training throughput (tokens per second per GPU), weight sync, cold starts and wakes from
  sleep, reward cost and price per GPU-second (how long idle workers stay awake is the
  policy's ``keep_alive``).

The built-in profiles are *derived*, not measured: decode is memory-bandwidth bound, so
``step_base_s`` is parameter bytes over achieved bandwidth; the rest follows from public spec
sheets and model configs with the efficiency factors named in ``derive_profile``. Each
number's source is in a comment. ``profile_from_run`` fits a profile from one of our own run
directories (the tiny CPU run: a "GPU" is then a Dask worker process).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .workloads import Batch, replay_trace


@dataclass(frozen=True)
class Hardware:
    name: str
    mem_gb: float  # memory per GPU
    mem_bw_gbs: float  # memory bandwidth per GPU, GB/s
    bf16_tflops: float  # dense BF16 tensor throughput per GPU
    node_link_gbs: float  # network bandwidth per node (weight sync between nodes), GB/s
    host_link_gbs: float  # host-to-GPU bandwidth per GPU (PCIe, one direction), GB/s
    price_per_gpu_s: float  # dollars per GPU-second (only for money; GPU-s is the metric)


@dataclass(frozen=True)
class Model:
    name: str
    params_b: float  # parameters, billions
    layers: int
    kv_heads: int
    head_dim: int
    tp: int  # GPUs per generation worker (tensor parallel degree)


# NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s, 362.05 TFLOPS BF16 dense (733 with sparsity),
# PCIe Gen4 x16 (32 GB/s each way). AWS g6e.48xlarge (8x L40S): 400 Gbps network = 50 GB/s;
# $30.131/h -> $0.001046 per GPU-s.
L40S = Hardware("L40S", 48.0, 864.0, 362.0, 50.0, 32.0, 30.131 / 3600 / 8)
# NVIDIA H100 SXM5 datasheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOPS BF16 dense (1,979 sparse),
# PCIe Gen5 x16 (64 GB/s each way). AWS p5.48xlarge (8x H100): 3,200 Gbps EFA = 400 GB/s;
# $98.32/h at launch -> $0.003414 per GPU-s.
H100 = Hardware("H100", 80.0, 3350.0, 989.0, 400.0, 64.0, 98.32 / 3600 / 8)

# Model cards and config.json on the Hugging Face Hub (bf16 weights, head_dim 128 for all):
# Qwen2.5-3B: 3.09B params, 36 layers, 16 Q / 2 KV heads (GQA), 32K context.
QWEN25_3B = Model("Qwen2.5-3B", 3.09, 36, 2, 128, tp=1)
# Qwen2.5-7B: 7.61B params, 28 layers, 28 Q / 4 KV heads (GQA).
QWEN25_7B = Model("Qwen2.5-7B", 7.61, 28, 4, 128, tp=1)
# Llama-2-70B: 69B params, 80 layers, 64 Q / 8 KV heads (GQA), 4K context; bf16 weights are
# 138 GB, so a generation worker is TP=4: the smallest power of two that leaves KV cache room
# on 80 GB GPUs (34.5 GB of weights each) [derived].
LLAMA2_70B = Model("Llama2-70B", 69.0, 80, 8, 128, tp=4)

# Efficiency factors [derived, not measured; typical of vLLM/FSDP reports, stated here once]:
BW_EFFICIENCY = 0.8  # achieved / peak memory bandwidth in decode
DECODE_MFU = 0.5  # achieved / peak FLOPs of the per-sequence decode compute
PREFILL_MFU = 0.6  # achieved / peak FLOPs in prefill
TRAIN_MFU = 0.35  # achieved / peak FLOPs of FSDP training
TRAIN_FLOPS_PER_PARAM = 8.0  # 6N forward+backward + 2N recomputing old log-probs (no ref model)
STEP_OVERHEAD_S = 1e-3  # scheduler + sampling per step with CUDA graphs
ALLREDUCE_S = 15e-6  # one NVLink all-reduce of a decode activation (2 per layer when tp > 1)
MEM_UTIL = 0.9  # vLLM gpu_memory_utilization default
# A full cold start (container, engine init, CUDA graphs, weights): vLLM's sleep-mode post
# (blog.vllm.ai, 2025-10-26) puts reloading a model at 30-100+ s per switch.
ENGINE_INIT_S = 30.0  # container start + engine init + CUDA graph capture, plus the load below
LOAD_GBS = 2.0  # weight load from local NVMe per GPU, GB/s [assumption]
TRAIN_INIT_S = 20.0  # learner process + FSDP/NCCL init [assumption]
# A wake from sleep (vLLM sleep mode level 1: weights parked in host RAM, process and CUDA
# graphs kept; the same post reports 18-200x faster than a reload): weights back over PCIe.
WAKE_FIXED_S = 0.5  # allocator + KV cache re-allocation on wake [assumption]
PCIE_EFFICIENCY = 0.5  # achieved / peak host-to-GPU bandwidth for pageable copies
SYNC_FIXED_S = 1.0  # weight publish + engine reload fixed cost [assumption]
NET_EFFICIENCY = 0.5  # achieved / peak network bandwidth for a weight broadcast
# Runpod serverless default idle timeout before a worker stops (docs.runpod.io/pricing);
# use it as PolicyConfig(keep_alive=KEEP_ALIVE_S) for a platform-managed keep-alive.
KEEP_ALIVE_S = 5.0
MAX_NUM_SEQS = 1024  # verl's default rollout max_num_seqs (vLLM engine batch cap)
REWARD_S_PER_SAMPLE = 2e-3  # rule-based math verifier on a CPU core [assumption]
REWARD_PARALLELISM = 32  # CPU cores scoring in parallel [assumption]


@dataclass(frozen=True)
class Profile:
    """Timing and price constants of one (hardware, model) pair; see the module docstring."""

    name: str
    tp: int  # GPUs per generation worker
    step_base_s: float  # decode step, fixed part (weights read once)
    step_per_seq_s: float  # decode step, per live sequence
    step_per_ctx_token_s: float  # decode step, per context token of the live sequences
    prefill_tokens_per_s: float  # per generation worker
    max_batch: int  # engine cap on live sequences per worker
    kv_capacity_tokens: int  # KV cache tokens per worker
    update_tokens_per_s_per_gpu: float  # (prompt + response) tokens trained per GPU-second
    update_overhead_s: float = 0.0  # fixed seconds per update
    sync_s: float = 0.0  # weight sync to the generation workers at each iteration start
    gen_cold_start_s: float = 0.0  # generation worker first start to ready
    gen_wake_s: float = 0.0  # generation worker wake from sleep (weights from host RAM)
    train_cold_start_s: float = 0.0  # learner first start (process + init), state load apart
    train_wake_fixed_s: float = 0.0  # learner wake from sleep, state load apart
    train_state_gb: float = 0.0  # learner state (weights, master, Adam) restored on any start
    host_link_gbs: float = 1.0  # achieved host-to-GPU GB/s per GPU (learner state restore)
    iteration_overhead_s: float = 0.0  # per-iteration fixed cost (orchestration, dedup plan)
    reward_s_per_sample: float = 0.0
    reward_parallelism: int = 1
    price_per_gpu_s: float = 1.0

    def step_seconds(self, batch: np.ndarray, ctx_tokens: np.ndarray) -> np.ndarray:
        """Seconds of decode steps with ``batch`` live sequences holding ``ctx_tokens``."""
        return (self.step_base_s + self.step_per_seq_s * np.asarray(batch, dtype=np.float64)
                + self.step_per_ctx_token_s * np.asarray(ctx_tokens, dtype=np.float64))

    def batch_cap(self, ctx_per_seq: float) -> int:
        """Live sequences per worker: the engine cap, or what the KV cache holds at
        ``ctx_per_seq`` tokens of context per sequence, whichever is smaller (at least 1)."""
        fits = self.kv_capacity_tokens // max(int(ctx_per_seq), 1)
        return int(max(1, min(self.max_batch, fits)))

    def train_start_seconds(self, gpus: int, cold: bool) -> float:
        """Learner start on ``gpus`` GPUs: init (cold only) + its state sharded over them."""
        load = self.train_state_gb / (gpus * self.host_link_gbs)
        return load + (self.train_cold_start_s if cold else self.train_wake_fixed_s)

    def update_seconds(self, tokens: float, gpus: int) -> float:
        """Seconds to train on ``tokens`` (prompt + response) with ``gpus`` learner GPUs."""
        return self.update_overhead_s + float(tokens) / (self.update_tokens_per_s_per_gpu * gpus)

    def reward_seconds(self, n_samples: int) -> float:
        return self.reward_s_per_sample * n_samples / self.reward_parallelism

    def replace(self, **changes: Any) -> Profile:
        return dataclasses.replace(self, **changes)

    def to_record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def derive_profile(hw: Hardware, model: Model) -> Profile:
    """A profile derived from spec sheets: bandwidth-bound decode, FLOP-bound prefill and
    training, with the efficiency factors above. Every result is a derivation, not a
    measurement; replace it with ``profile_from_run`` numbers when a run exists."""
    tp = model.tp
    param_bytes = model.params_b * 1e9 * 2  # bf16
    kv_bytes_per_token = 2 * model.layers * model.kv_heads * model.head_dim * 2  # K and V, bf16
    bw = hw.mem_bw_gbs * 1e9 * BW_EFFICIENCY * tp  # a worker's GPUs read in parallel
    flops = hw.bf16_tflops * 1e12 * tp
    allreduce = 2 * model.layers * ALLREDUCE_S if tp > 1 else 0.0
    kv_bytes_free = hw.mem_gb * 1e9 * tp * MEM_UTIL - param_bytes
    if kv_bytes_free <= 0:
        raise ValueError(
            f"derive_profile: {model.name} ({param_bytes / 1e9:.0f} GB) does not fit on "
            f"{tp} x {hw.name}; raise the model's tp"
        )
    load_s = param_bytes / tp / (LOAD_GBS * 1e9)
    pcie = hw.host_link_gbs * PCIE_EFFICIENCY
    return Profile(
        name=f"{model.name}@{hw.name}",
        tp=tp,
        step_base_s=param_bytes / bw + STEP_OVERHEAD_S + allreduce,
        step_per_seq_s=2 * model.params_b * 1e9 / (flops * DECODE_MFU),
        step_per_ctx_token_s=kv_bytes_per_token / bw,
        prefill_tokens_per_s=flops * PREFILL_MFU / (2 * model.params_b * 1e9),
        max_batch=MAX_NUM_SEQS,
        kv_capacity_tokens=int(kv_bytes_free / kv_bytes_per_token),
        update_tokens_per_s_per_gpu=hw.bf16_tflops * 1e12 * TRAIN_MFU
        / (TRAIN_FLOPS_PER_PARAM * model.params_b * 1e9),
        update_overhead_s=2.0,  # optimizer step + gradient sync fixed part [assumption]
        sync_s=SYNC_FIXED_S + param_bytes / (hw.node_link_gbs * 1e9 * NET_EFFICIENCY),
        gen_cold_start_s=ENGINE_INIT_S + load_s,
        gen_wake_s=WAKE_FIXED_S + param_bytes / tp / (pcie * 1e9),
        train_cold_start_s=TRAIN_INIT_S,
        train_wake_fixed_s=WAKE_FIXED_S,
        # bf16 weights + fp32 master weights + two fp32 Adam moments = 14 bytes per parameter
        train_state_gb=14 * model.params_b,
        host_link_gbs=pcie,
        iteration_overhead_s=0.5,  # dedup plan, scheduling decision, data loading [assumption]
        reward_s_per_sample=REWARD_S_PER_SAMPLE,
        reward_parallelism=REWARD_PARALLELISM,
        price_per_gpu_s=hw.price_per_gpu_s,
    )


PROFILES: dict[str, Profile] = {
    f"{m.name}@{h.name}": derive_profile(h, m)
    for h in (L40S, H100)
    for m in (QWEN25_3B, QWEN25_7B, LLAMA2_70B)
    if h.mem_gb * m.tp * MEM_UTIL > m.params_b * 2
}


def get_profile(name: str) -> Profile:
    """A built-in profile by ``"<model>@<hardware>"``, e.g. ``"Qwen2.5-3B@L40S"``."""
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; built-in profiles: {sorted(PROFILES)}")
    return PROFILES[name]


# ---- a profile fitted from one of our own runs ------------------------------------------------


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
