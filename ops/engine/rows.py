"""Rollout rows of a shard, free of torch: one row per (prompt, sample), its sampling key,
and the generation columns of ``schema.ROLLOUTS`` appended from an engine's results."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from ..data.schema import ROLLOUTS
from .seeds import sequence_keys


def row_keys(seed: int, rows: pa.Table) -> np.ndarray:
    """The sampling keys of ``rows`` (one per sequence: ``prompt_id``, ``sample_idx``)."""
    return sequence_keys(seed, rows.column("prompt_id").to_pylist(),
                         rows.column("sample_idx").to_pylist())


def expand_samples(prompts: pa.Table, n_samples: int) -> pa.Table:
    """One row per (prompt, sample), prompt-major, with ``sample_idx`` appended: the row
    order in which ``prefill_prompts`` numbers its sequences."""
    # typed indices: an empty Python list would infer a null type that take() rejects
    order = pa.array([i for i in range(len(prompts)) for _ in range(n_samples)], pa.int64())
    sample_idx = pa.array([s for _ in range(len(prompts)) for s in range(n_samples)], pa.int32())
    return prompts.take(order).append_column(ROLLOUTS.field("sample_idx"), sample_idx)


def rollouts_table(rows: pa.Table, results: list[tuple[list[int], list[float], str]],
                   tokenizer, *, policy_version: int, worker: str, start: float,
                   end: float) -> pa.Table:
    """``rows`` (one per sequence, ``sample_idx`` included) with the generation columns of
    ``schema.ROLLOUTS`` appended from ``results`` (token ids, logprobs, finish reason)."""
    n = len(results)
    if n != len(rows):
        raise ValueError(f"rollouts_table: {len(rows)} rows but {n} results")
    # no rows: no call (some transformers releases decode an empty batch as one empty text)
    texts = tokenizer.batch_decode([r[0] for r in results], skip_special_tokens=True) if n else []
    added = {
        "response_ids": pa.array([r[0] for r in results], pa.list_(pa.int32())),
        "response_text": pa.array(texts, pa.string()),
        "logprobs": pa.array([r[1] for r in results], pa.list_(pa.float32())),
        "finish_reason": pa.array([r[2] for r in results], pa.string()),
        "policy_version": pa.array([policy_version] * n, pa.int64()),
        "worker": pa.array([worker] * n, pa.string()),
        "gen_start": pa.array([start] * n, pa.float64()),
        "gen_end": pa.array([end] * n, pa.float64()),
    }
    for name, column in added.items():
        rows = rows.append_column(ROLLOUTS.field(name), column)
    return rows


def prefix_lens_of(prompts: pa.Table, share_prefixes: bool) -> list[int] | None:
    """The sharing argument of ``prefill_prompts`` for a shard: ``None`` (no sharing at all)
    or each prompt's shared-prefix length from the plan (0 without a plan)."""
    if not share_prefixes:
        return None
    if "prefix_len" in prompts.column_names:
        return prompts.column("prefix_len").to_pylist()
    return [0] * len(prompts)


def cut_rows(rows: pa.Table, results: list[tuple[list[int], list[float], str]],
             unfinished: list[int], tokenizer, *, policy_version: int, worker: str,
             start: float) -> tuple[pa.Table, pa.Table]:
    """(the finished rows as rollouts, the ``unfinished`` ones as cut rows) of ``rows`` (one
    per sequence) given every sequence's results so far."""
    pending = set(unfinished)
    done = [i for i in range(len(rows)) if i not in pending]
    table = rollouts_table(rows.take(pa.array(done, pa.int64())), [results[i] for i in done],
                           tokenizer, policy_version=policy_version, worker=worker,
                           start=start, end=time.time())
    cut = rows.take(pa.array(unfinished, pa.int64()))
    cut = cut.append_column("partial_ids", pa.array([results[i][0] for i in unfinished],
                                                    pa.list_(pa.int32())))
    cut = cut.append_column("partial_logprobs", pa.array([results[i][1] for i in unfinished],
                                                         pa.list_(pa.float32())))
    return table, cut
