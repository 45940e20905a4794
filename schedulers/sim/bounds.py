"""The best any scheduler could do on a trace, given the update: per-iteration lower bounds.

For one batch and a profile (its TP, its learner), whatever the scheduler:

- *time*: the iteration overhead and weight sync, then the longest sequence decoded on its
  own (a batch of one: every step is the weights read plus that sequence's context) at the
  fastest TP inside a node (PAT can merge a tail up to it), then
  the update of the shared-prompt token count with every forward-only pass hidden (run on
  released generation GPUs while the tail decodes);
- *GPU-seconds*: every decode token at a full engine batch (the weights read once per
  ``cap`` sequences), each group's prompt prefilled once, plus the learner's update and
  forward passes (the same work wherever it runs).

The bounds ignore cold starts, wakes and reward time (a scheduler can hide them), so no
simulated policy reaches them; the report prints them beside the policies as the ceiling
of what scheduling can buy.
"""

from __future__ import annotations

import numpy as np

from ..profiles import Profile
from .sim_pat import NODE_GPUS
from .workloads import Trace


def node_variants(profile: Profile) -> list[Profile]:
    """``profile`` at every TP a worker can reach inside a node (PAT merges up to it)."""
    return [profile.variant(tp=t) for t in profile.feasible_tps()
            if profile.tp <= t <= NODE_GPUS] or [profile]


def longest_alone_seconds(lengths: np.ndarray, prompts: np.ndarray,
                          variants: list[Profile]) -> float:
    """Seconds to prefill and decode a batch's longest sequence on its own (a batch of one:
    every step is the weights read plus that sequence's context) at the fastest TP."""
    g = int(np.argmax(lengths.max(axis=1)))
    longest, p = float(lengths[g].max()), float(prompts[g])
    ctx_sum = longest * p + longest * (longest - 1) / 2  # context over its steps
    return min(p / v.prefill_tokens_per_s + longest * (v.step_base_s + v.step_per_seq_s)
               + v.step_per_ctx_token_s * ctx_sum for v in variants)


def generation_bound(trace: Trace, profile: Profile) -> float:
    """Mean seconds of decoding each batch's longest sequence alone at the fastest TP inside
    a node: no TP schedule (PAT's included) generates a batch faster, sync and switch
    apart."""
    variants = node_variants(profile)
    return float(np.mean([longest_alone_seconds(b.lengths.astype(np.float64),
                                                b.prompt_tokens.astype(np.float64), variants)
                          for b in trace.batches]))


def iteration_bounds(trace: Trace, profile: Profile, train_gpus: int,
                     cap: int) -> dict[str, float]:
    """Mean step seconds and GPU-seconds per iteration no scheduler can beat on ``trace``;
    generation at the best TP a worker can reach inside a node (PAT merges up to it)."""
    variants = node_variants(profile)
    steps, gpu_s = [], []
    for b in trace.batches:
        lengths = b.lengths.astype(np.float64)
        prompts = b.prompt_tokens.astype(np.float64)
        gen_lb = longest_alone_seconds(lengths, prompts, variants)
        tokens = float(lengths.sum() + prompts.sum())  # prompts once (shared-prompt forward)
        update = profile.update_seconds(tokens, train_gpus)
        steps.append(profile.iteration_overhead_s + profile.sync_s + gen_lb + update)
        ctx_avg = float(np.mean(prompts[:, None] + lengths / 2))
        per_token = min((v.step_base_s / cap + v.step_per_seq_s
                         + v.step_per_ctx_token_s * ctx_avg) * v.tp for v in variants)
        prefill = float(prompts.sum()) / profile.prefill_tokens_per_s * profile.tp
        learner = (update + profile.forward_seconds(tokens, train_gpus)) * train_gpus
        gpu_s.append(lengths.sum() * per_token + prefill + learner)
    return {"step_s": float(np.mean(steps)), "gpu_s_per_iteration": float(np.mean(gpu_s))}
