"""Hardware × model profiles for the simulator, as data, plus a profile fitted from a real run.

A ``Profile`` holds what the simulator needs to time one RLHF iteration on a pool of GPUs:

- decode step of one generation worker (a tensor-parallel group of ``tp`` GPUs)::

      t_step = step_base_s + step_per_seq_s * live_sequences + step_per_ctx_token_s * ctx_tokens

  where ``ctx_tokens`` sums the context (prompt + generated) of the live sequences: the
  weights are read once per step (base), each sequence costs compute (per seq), and each
  context token's KV is read once per step (per ctx token);
- prefill rate, engine batch cap and KV capacity of a worker;
- training throughput (tokens per second per GPU), weight sync, cold starts, keep-alive,
  reward cost and price per GPU-second.

The built-in profiles are *derived*, not measured: decode is memory-bandwidth bound, so
``step_base_s`` is parameter bytes over achieved bandwidth; the rest follows from public spec
sheets and model configs with the efficiency factors named in ``derive_profile``. Each
number's source is in a comment. ``profile_from_run`` fits a profile from one of our own run
directories (the tiny CPU run: a "GPU" is then a Dask worker process).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Hardware:
    name: str
    mem_gb: float  # memory per GPU
    mem_bw_gbs: float  # memory bandwidth per GPU, GB/s
    bf16_tflops: float  # dense BF16 tensor throughput per GPU
    node_link_gbs: float  # network bandwidth per node (weight sync between nodes), GB/s
    price_per_gpu_s: float  # dollars per GPU-second (only for money; GPU-s is the metric)


@dataclass(frozen=True)
class Model:
    name: str
    params_b: float  # parameters, billions
    layers: int
    kv_heads: int
    head_dim: int
    tp: int  # GPUs per generation worker (tensor parallel degree)


# NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s, 362.05 TFLOPS BF16 dense (733 with sparsity).
# AWS g6e.48xlarge (8x L40S): 400 Gbps network = 50 GB/s; $30.131/h -> $0.001046 per GPU-s.
L40S = Hardware("L40S", 48.0, 864.0, 362.0, 50.0, 30.131 / 3600 / 8)
# NVIDIA H100 SXM5 datasheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOPS BF16 dense (1,979 sparse).
# AWS p5.48xlarge (8x H100): 3,200 Gbps EFA = 400 GB/s; $98.32/h at launch -> $0.003414/GPU-s.
H100 = Hardware("H100", 80.0, 3350.0, 989.0, 400.0, 98.32 / 3600 / 8)

# Model cards and config.json on the Hugging Face Hub (bf16 weights, head_dim 128 for all):
# Qwen2.5-3B: 3.09B params, 36 layers, 16 Q / 2 KV heads (GQA), 32K context.
QWEN25_3B = Model("Qwen2.5-3B", 3.09, 36, 2, 128, tp=1)
# Qwen2.5-7B: 7.61B params, 28 layers, 28 Q / 4 KV heads (GQA).
QWEN25_7B = Model("Qwen2.5-7B", 7.61, 28, 4, 128, tp=1)
# Llama-2-70B: 69B params, 80 layers, 64 Q / 8 KV heads (GQA), 4K context; bf16 weights are
# 138 GB, so a generation worker is TP=4 (34.5 GB of weights per 80 GB GPU), as in Vidur's
# Llama-2-70B configurations.
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
ENGINE_INIT_S = 30.0  # container start + engine init + CUDA graph capture [assumption]
LOAD_GBS = 2.0  # weight load from local NVMe per GPU, GB/s [assumption]
TRAIN_INIT_S = 20.0  # learner process + FSDP/NCCL init [assumption]
HOST_GBS = 10.0  # learner state restore from host memory per GPU, GB/s [assumption]
SYNC_FIXED_S = 1.0  # weight publish + engine reload fixed cost [assumption]
NET_EFFICIENCY = 0.5  # achieved / peak network bandwidth for a weight broadcast
KEEP_ALIVE_S = 5.0  # Runpod serverless default idle timeout before a worker stops
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
    gen_cold_start_s: float = 0.0  # generation worker start to ready
    train_cold_start_s: float = 0.0  # learner start to ready (state restored)
    keep_alive_s: float = KEEP_ALIVE_S  # idle seconds before a released worker stops
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
        # learner state: bf16 weights + fp32 master + two Adam moments = 16 bytes/param,
        # sharded over the learner's GPUs (the simulator divides by their number)
        train_cold_start_s=TRAIN_INIT_S + 16 * model.params_b * 1e9 / (8 * HOST_GBS * 1e9),
        keep_alive_s=KEEP_ALIVE_S,
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
