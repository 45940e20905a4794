"""Hardware × model × engine profiles for the simulator, as data, each number with its source.

A ``Profile`` holds what the simulator needs to time one RLHF iteration on a pool of GPUs:

- decode step of one generation worker (a tensor-parallel group of ``tp`` GPUs)::

      t_step = step_base_s + step_per_seq_s * live_sequences + step_per_ctx_token_s * ctx_tokens

  where ``ctx_tokens`` sums the context (prompt + generated) of the live sequences: the
  weights are read once per step and two all-reduces per layer pay their latency (base),
  each sequence costs compute and its share of the all-reduce volume (per seq), and each
  context token's KV is read once per step (per ctx token);
- prefill rate, engine batch cap and KV capacity of a worker; KV bytes per token and the
  GPU-to-GPU bandwidth a KV transfer would use (cut-and-migrate, PAT);
- the learner: the update (forward + backward + recomputation under gradient checkpointing)
  and the forward-only passes the algorithm needs (old log-probs, reference), in tokens per
  second per GPU; weight sync, cold starts, wakes from sleep, reward cost and price.

The built-in profiles are *derived*, not measured: decode is memory-bandwidth bound (weights
over achieved bandwidth), prefill and training FLOP-bound, from public spec sheets and model
configs with the efficiency factors below. An ``Engine`` says how the generation engine runs:
verl 0.3's rollout defaults (eager, TP 2, half the memory for KV) or a tuned one (CUDA graphs,
90 % of memory); ``Profile.variant`` re-derives a profile for another engine or TP, keeping
any field a scenario overrode. ``profile_fit.profile_from_run`` fits a profile from one of our
own run directories instead.

Calibration of the generation/update split (``../shared`` research notes, published verl
logs): the learner's update/forward ratio of 8N:2N FLOPs per token matches verl's logged
``update_actor`` vs ``old_log_prob`` times (3.2x Qwen2-7B GSM8K, 4.2x deepseek-7B, 4.05x
Qwen2-7B GSM8K+MATH), and ``TRAIN_MFU`` puts the verl-0.3 GSM8K step of the paper-physical
scenario at a generation share inside the published 25-51 % band (the scenario reports it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Hardware:
    name: str
    mem_gb: float  # memory per GPU
    mem_bw_gbs: float  # memory bandwidth per GPU, GB/s
    bf16_tflops: float  # dense BF16 tensor throughput per GPU
    node_link_gbs: float  # network bandwidth per node (weight sync between nodes), GB/s
    host_link_gbs: float  # host-to-GPU bandwidth per GPU (PCIe, one direction), GB/s
    gpu_link_gbs: float  # GPU-to-GPU bandwidth inside a node, one direction, GB/s
    allreduce_latency_s: float  # one small all-reduce inside a node (latency-bound)
    price_per_gpu_s: float  # dollars per GPU-second (only for money; GPU-s is the metric)


@dataclass(frozen=True)
class Model:
    name: str
    params_b: float  # parameters, billions
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int  # model width: the size of a decode activation all-reduced per layer
    tp: int  # default GPUs per generation worker: the smallest power of two that fits


@dataclass(frozen=True)
class Engine:
    """How a generation engine runs: TP (None: the model's default), the fraction of GPU
    memory vLLM may use (weights + KV cache), and whether decode steps are CUDA graphs."""

    name: str
    tp: int | None
    mem_util: float
    cuda_graphs: bool


# NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s, 362.05 TFLOPS BF16 dense (733 with sparsity),
# PCIe Gen4 x16 (32 GB/s each way), no NVLink: peer traffic goes over PCIe (32 GB/s). AWS
# g6e.48xlarge (8x L40S): 400 Gbps network = 50 GB/s; $30.131/h -> $0.001046 per GPU-s.
# A small NCCL all-reduce over PCIe: 30 us [assumption; nccl-tests small-message latency].
L40S = Hardware("L40S", 48.0, 864.0, 362.0, 50.0, 32.0, 32.0, 30e-6, 30.131 / 3600 / 8)
# NVIDIA H100 SXM5 datasheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOPS BF16 dense (1,979 sparse),
# PCIe Gen5 x16 (64 GB/s each way), NVLink 4 900 GB/s (450 each way). AWS p5.48xlarge
# (8x H100): 3,200 Gbps EFA = 400 GB/s; $98.32/h at launch -> $0.003414 per GPU-s.
# A small NCCL all-reduce over NVLink: 15 us [assumption; nccl-tests small-message latency].
H100 = Hardware("H100", 80.0, 3350.0, 989.0, 400.0, 64.0, 450.0, 15e-6, 98.32 / 3600 / 8)

# Model cards and config.json on the Hugging Face Hub (bf16 weights, head_dim 128 for all):
# Qwen2.5-3B: 3.09B params, 36 layers, hidden 2048, 16 Q / 2 KV heads (GQA).
QWEN25_3B = Model("Qwen2.5-3B", 3.09, 36, 2, 128, 2048, tp=1)
# Qwen2.5-7B: 7.61B params, 28 layers, hidden 3584, 28 Q / 4 KV heads.
QWEN25_7B = Model("Qwen2.5-7B", 7.61, 28, 4, 128, 3584, tp=1)
# Llama-3.1-8B: 8.03B params, 32 layers, hidden 4096, 32 Q / 8 KV heads (PAT's first model).
LLAMA31_8B = Model("Llama3.1-8B", 8.03, 32, 8, 128, 4096, tp=1)
# Qwen3-14B: 14.8B params, 40 layers, hidden 5120, 40 Q / 8 KV heads (PAT's second model).
QWEN3_14B = Model("Qwen3-14B", 14.8, 40, 8, 128, 5120, tp=1)
# Llama-2-70B: 69B params, 80 layers, hidden 8192, 64 Q / 8 KV heads; bf16 weights are
# 138 GB, so a worker is TP=4: the smallest power of two that leaves KV room on 80 GB GPUs.
LLAMA2_70B = Model("Llama2-70B", 69.0, 80, 8, 128, 8192, tp=4)
MODELS = (QWEN25_3B, QWEN25_7B, LLAMA31_8B, QWEN3_14B, LLAMA2_70B)
TP_CHOICES = (1, 2, 4, 8)  # tensor-parallel degrees inside one 8-GPU node

# verl 0.3's rollout defaults (ppo_trainer.yaml, identical v0.2.0.post2 ... v0.4.0): TP 2,
# gpu_memory_utilization 0.5, enforce_eager True, free_cache_engine True (the cache freed
# and re-allocated around every update: the colocated stage switch the simulator charges).
VERL_03 = Engine("verl-0.3", tp=2, mem_util=0.5, cuda_graphs=False)
# verl with vLLM >= 0.8 as its notes recommend: CUDA graphs, 0.9 of memory, the best TP (the
# scenario picks the fastest feasible one by simulating each).
VERL_TUNED = Engine("verl-tuned", tp=None, mem_util=0.9, cuda_graphs=True)
# Our actors on a dedicated pool: nothing else shares their memory, CUDA graphs kept warm.
DEDICATED = Engine("dedicated", tp=None, mem_util=0.9, cuda_graphs=True)
ENGINES = {e.name: e for e in (DEDICATED, VERL_03, VERL_TUNED)}

# Efficiency factors [derived, not measured; typical of vLLM/FSDP reports, stated here once]:
BW_EFFICIENCY = 0.8  # achieved / peak memory bandwidth in decode
DECODE_MFU = 0.5  # achieved / peak FLOPs of the per-sequence decode compute
PREFILL_MFU = 0.6  # achieved / peak FLOPs in prefill
LINK_EFFICIENCY = 0.7  # achieved / peak GPU-to-GPU bandwidth (all-reduce volume, KV moves)
# FSDP training MFU; calibrated: puts verl-0.3's GSM8K generation share in the published band
TRAIN_MFU = 0.35
UPDATE_FLOPS_PER_PARAM = 8.0  # 6N forward + backward, + 2N recomputed under checkpointing
FORWARD_FLOPS_PER_PARAM = 2.0  # a forward-only pass (old log-probs; the reference policy)
LEARNER_FORWARD_PASSES = 2  # old log-probs + reference (GRPO with KL loss, verl's examples)
STEP_OVERHEAD_S = 1e-3  # scheduler + sampling per step with CUDA graphs
# enforce_eager: verl docs/README_vllm0.7.md logs Qwen2-7B rollout 90 s eager vs 65 s with
# CUDA graphs on, the same batch: every decode step takes 90/65 as long without graphs.
EAGER_FACTOR = 90.0 / 65.0
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
# PolicyConfig(keep_alive_s=KEEP_ALIVE_S) keeps a worker only through idle gaps that short.
KEEP_ALIVE_S = 5.0
MAX_NUM_SEQS = 1024  # verl's default rollout max_num_seqs (vLLM engine batch cap)
REWARD_S_PER_SAMPLE = 2e-3  # rule-based math verifier on a CPU core [assumption]
REWARD_PARALLELISM = 32  # CPU cores scoring in parallel [assumption]
UPDATE_OVERHEAD_S = 2.0  # optimizer step + gradient sync fixed part [assumption]
ITERATION_OVERHEAD_S = 0.5  # dedup plan, scheduling decision, data loading [assumption]


@dataclass(frozen=True)
class Profile:
    """Timing and price constants of one (hardware, model, engine); see the module docstring."""

    name: str
    tp: int  # GPUs per generation worker
    step_base_s: float  # decode step, fixed part (weights read once, all-reduce latency)
    step_per_seq_s: float  # decode step, per live sequence
    step_per_ctx_token_s: float  # decode step, per context token of the live sequences
    prefill_tokens_per_s: float  # per generation worker
    max_batch: int  # engine cap on live sequences per worker
    kv_capacity_tokens: int  # KV cache tokens per worker
    update_tokens_per_s_per_gpu: float  # (prompt + response) tokens trained per GPU-second
    update_overhead_s: float = 0.0  # fixed seconds per update
    forward_tokens_per_s_per_gpu: float = 0.0  # one forward-only learner pass, per GPU
    learner_forward_passes: int = 0  # forward-only passes per iteration (old log-prob, ref)
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
    kv_bytes_per_token: float = 0.0  # KV cache bytes of one context token (whole model)
    kv_link_gbs: float = 0.0  # achieved GB/s of a KV transfer between workers; 0: none
    param_gb: float = 0.0  # bf16 weights of the whole model
    engine: str = "dedicated"
    hardware: Hardware | None = None  # what it was derived from (None: fitted from a run)
    model: Model | None = None

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

    def forward_seconds(self, tokens: float, gpus: int, passes: int | None = None) -> float:
        """Seconds of ``passes`` (default: all the algorithm's) forward-only passes over
        ``tokens`` on ``gpus`` GPUs; 0 for a profile without separate forwards."""
        passes = self.learner_forward_passes if passes is None else passes
        if passes == 0 or self.forward_tokens_per_s_per_gpu <= 0:
            return 0.0
        return passes * float(tokens) / (self.forward_tokens_per_s_per_gpu * gpus)

    def kv_transfer_seconds(self, tokens: float) -> float:
        """Seconds to ship the KV cache of ``tokens`` context tokens to another worker
        (inf when the profile has no transfer path: recomputation only)."""
        if self.kv_link_gbs <= 0 or self.kv_bytes_per_token <= 0:
            return float("inf")
        return float(tokens) * self.kv_bytes_per_token / (self.kv_link_gbs * 1e9)

    def reward_seconds(self, n_samples: int) -> float:
        return self.reward_s_per_sample * n_samples / self.reward_parallelism

    def feasible_tps(self, engine: str | None = None) -> list[int]:
        """TP degrees at which the model fits with ``engine``'s memory share; [tp] when the
        profile was fitted from a run."""
        if self.hardware is None or self.model is None:
            return [self.tp]
        eng = ENGINES[engine or self.engine]
        return [t for t in TP_CHOICES if _kv_bytes_free(self.hardware, self.model, eng, t) > 0]

    def variant(self, engine: str | None = None, tp: int | None = None) -> Profile:
        """This profile re-derived for another engine and/or TP; fields a scenario overrode
        (differing from this profile's own derivation) are kept. A fitted profile has no
        variants: it is returned as it is."""
        if self.hardware is None or self.model is None:
            return self
        own = derive_profile(self.hardware, self.model, ENGINES[self.engine], self.tp)
        new = derive_profile(self.hardware, self.model, ENGINES[engine or self.engine],
                             tp or (None if engine else self.tp))
        kept = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("name", "tp", "engine")
                and getattr(self, f.name) != getattr(own, f.name)}
        return new.replace(**kept)

    def replace(self, **changes: Any) -> Profile:
        return dataclasses.replace(self, **changes)

    def to_record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _kv_bytes_free(hw: Hardware, model: Model, engine: Engine, tp: int) -> float:
    return hw.mem_gb * 1e9 * tp * engine.mem_util - model.params_b * 1e9 * 2


def derive_profile(hw: Hardware, model: Model, engine: Engine = DEDICATED,
                   tp: int | None = None) -> Profile:
    """A profile derived from spec sheets: bandwidth-bound decode, FLOP-bound prefill and
    training, with the efficiency factors above; TP is ``tp``, else the engine's, else the
    model's. Every result is a derivation, not a measurement."""
    tp = int(tp or engine.tp or model.tp)
    param_bytes = model.params_b * 1e9 * 2  # bf16
    kv_bytes_per_token = 2 * model.layers * model.kv_heads * model.head_dim * 2  # K and V, bf16
    bw = hw.mem_bw_gbs * 1e9 * BW_EFFICIENCY * tp  # a worker's GPUs read in parallel
    flops = hw.bf16_tflops * 1e12 * tp
    link = hw.gpu_link_gbs * 1e9 * LINK_EFFICIENCY
    # two all-reduces per layer when tp > 1: latency once per step, and per sequence its
    # activation (hidden x bf16), of which a ring moves 2 (tp - 1) / tp over each GPU's link
    allreduce_base = 2 * model.layers * hw.allreduce_latency_s if tp > 1 else 0.0
    allreduce_seq = (2 * model.layers * model.hidden * 2 * 2 * (tp - 1) / tp / link
                     if tp > 1 else 0.0)
    kv_bytes_free = _kv_bytes_free(hw, model, engine, tp)
    if kv_bytes_free <= 0:
        raise ValueError(
            f"derive_profile: {model.name} ({param_bytes / 1e9:.0f} GB) does not fit on "
            f"{tp} x {hw.name} at gpu_memory_utilization {engine.mem_util}; raise the tp"
        )
    eager = 1.0 if engine.cuda_graphs else EAGER_FACTOR
    load_s = param_bytes / tp / (LOAD_GBS * 1e9)
    pcie = hw.host_link_gbs * PCIE_EFFICIENCY
    train_flops = hw.bf16_tflops * 1e12 * TRAIN_MFU / (model.params_b * 1e9)
    return Profile(
        name=f"{model.name}@{hw.name}" + ("" if engine is DEDICATED else f"/{engine.name}")
        + ("" if tp == model.tp else f"/tp{tp}"),
        tp=tp,
        step_base_s=eager * (param_bytes / bw + STEP_OVERHEAD_S + allreduce_base),
        step_per_seq_s=eager * (2 * model.params_b * 1e9 / (flops * DECODE_MFU)
                                + allreduce_seq),
        step_per_ctx_token_s=eager * kv_bytes_per_token / bw,
        prefill_tokens_per_s=flops * PREFILL_MFU / (2 * model.params_b * 1e9),
        max_batch=MAX_NUM_SEQS,
        kv_capacity_tokens=int(kv_bytes_free / kv_bytes_per_token),
        update_tokens_per_s_per_gpu=train_flops / UPDATE_FLOPS_PER_PARAM,
        update_overhead_s=UPDATE_OVERHEAD_S,
        forward_tokens_per_s_per_gpu=train_flops / FORWARD_FLOPS_PER_PARAM,
        learner_forward_passes=LEARNER_FORWARD_PASSES,
        sync_s=SYNC_FIXED_S + param_bytes / (hw.node_link_gbs * 1e9 * NET_EFFICIENCY),
        gen_cold_start_s=ENGINE_INIT_S + load_s,
        gen_wake_s=WAKE_FIXED_S + param_bytes / tp / (pcie * 1e9),
        train_cold_start_s=TRAIN_INIT_S,
        train_wake_fixed_s=WAKE_FIXED_S,
        # bf16 weights + fp32 master weights + two fp32 Adam moments = 14 bytes per parameter
        train_state_gb=14 * model.params_b,
        host_link_gbs=pcie,
        iteration_overhead_s=ITERATION_OVERHEAD_S,
        reward_s_per_sample=REWARD_S_PER_SAMPLE,
        reward_parallelism=REWARD_PARALLELISM,
        price_per_gpu_s=hw.price_per_gpu_s,
        kv_bytes_per_token=float(kv_bytes_per_token),
        # a KV move crosses the slower of the GPU link and the node network
        kv_link_gbs=min(hw.gpu_link_gbs, hw.node_link_gbs) * LINK_EFFICIENCY,
        param_gb=param_bytes / 1e9,
        engine=engine.name,
        hardware=hw,
        model=model,
    )


PROFILES: dict[str, Profile] = {
    f"{m.name}@{h.name}": derive_profile(h, m)
    for h in (L40S, H100)
    for m in MODELS
    if _kv_bytes_free(h, m, DEDICATED, m.tp) > 0
}


def get_profile(name: str) -> Profile:
    """A built-in profile by ``"<model>@<hardware>"``, e.g. ``"Qwen2.5-3B@L40S"``."""
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; built-in profiles: {sorted(PROFILES)}")
    return PROFILES[name]
