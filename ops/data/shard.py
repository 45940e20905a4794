"""Shard: split a batch of prompts into work for generation workers.

A prompt row stands for its whole group of n samples, so splitting rows keeps every group
on one worker (GRPO/RLOO need the group together). Within a shard the rows keep their
order, and rows of one prefix group stay adjacent when the split is contiguous, so a shared
prefix is prefilled once per shard rather than once per prompt.

``split_balanced`` cuts the batch into contiguous runs of about equal prompt tokens;
``take_shards`` applies an assignment computed elsewhere (the length-aware policies in
``rlhfless.schedulers`` return index lists).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa


def split_balanced(prompts: pa.Table, n_shards: int) -> list[pa.Table]:
    """Exactly ``n_shards`` contiguous shards of about equal total prompt tokens (some are
    empty when there are fewer prompts than shards)."""
    if n_shards < 1:
        raise ValueError(f"split_balanced: n_shards must be >= 1, got {n_shards}")
    if "prefix_group" in prompts.column_names:  # keep prefix groups adjacent
        order = np.argsort(prompts.column("prefix_group").to_numpy(), kind="stable")
        prompts = prompts.take(order)
    tokens = np.array([len(p) for p in prompts.column("prompt_ids").to_pylist()], dtype=float)
    bounds = np.cumsum(tokens)
    total = bounds[-1] if len(bounds) else 0.0
    cuts = np.searchsorted(bounds, total * np.arange(1, n_shards) / n_shards, side="left")
    edges = [0, *[int(c) + 1 for c in cuts], len(prompts)]
    return [prompts.slice(a, max(0, b - a)) for a, b in zip(edges[:-1], edges[1:])]


def take_shards(prompts: pa.Table, assignment: Sequence[Sequence[int]]) -> list[pa.Table]:
    """One shard per index list; every row must be assigned exactly once."""
    seen = np.zeros(len(prompts), dtype=int)
    for indices in assignment:
        idx = np.asarray(indices, dtype=int)
        if len(idx) and (idx.min() < 0 or idx.max() >= len(prompts)):
            raise ValueError(f"take_shards: index out of range 0..{len(prompts) - 1}")
        np.add.at(seen, idx, 1)
    if (seen != 1).any():
        bad = np.flatnonzero(seen != 1)[:5].tolist()
        raise ValueError(f"take_shards: rows {bad} assigned {seen[bad].tolist()} times, not once")
    return [prompts.take(np.asarray(i, dtype=int)) for i in assignment]
