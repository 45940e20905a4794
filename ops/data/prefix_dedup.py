"""Prefix dedup: plan which token prefixes are prefilled once instead of many times.

Two kinds of sharing are planned:

* the n samples of a prompt share the whole prompt: it is prefilled once and its KV cache
  is repeated n times (this alone saves (n-1)/n of the prefill);
* prompts that share a token prefix (a template, a system prompt, few-shot examples) form
  a *prefix group*: the prefix is prefilled once per group and each prompt prefills only
  its own suffix on top of it.

Groups come from the prompts sorted by token ids: adjacent prompts whose longest common
prefix is at least ``min_prefix`` tokens are chained into one group, whose shared prefix
is the common prefix of all its members. Every member keeps at least one suffix token, so
the logits of its last prompt token come out of the batched suffix prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from .schema import PROMPTS, check_columns


@dataclass(frozen=True)
class PrefixPlan:
    """The prompts with ``prefix_group`` (int32) and ``prefix_len`` (int32) appended, and
    the prefill tokens that a generation without sharing and with this plan would compute."""

    prompts: pa.Table
    naive_prefill_tokens: int
    planned_prefill_tokens: int

    @property
    def saved_prefill_tokens(self) -> int:
        return self.naive_prefill_tokens - self.planned_prefill_tokens


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def plan_prefixes(prompts: pa.Table, n_samples: int, min_prefix: int = 4) -> PrefixPlan:
    """Group ``prompts`` (reads ``prompt_ids``) by shared token prefix; see the module doc."""
    check_columns(prompts, PROMPTS, "plan_prefixes")
    if n_samples < 1:
        raise ValueError(f"plan_prefixes: n_samples must be >= 1, got {n_samples}")
    ids: list[list[int]] = prompts.column("prompt_ids").to_pylist()
    for row, seq in enumerate(ids):
        if not seq:
            raise ValueError(f"plan_prefixes: prompt at row {row} has no tokens")
    order = sorted(range(len(ids)), key=lambda i: ids[i])
    group = [0] * len(ids)
    prefix_len = [0] * len(ids)
    run: list[int] = []
    run_prefix = 0
    next_group = 0

    def close_run() -> None:
        nonlocal next_group
        # one prefix per group, short enough that every member keeps a suffix token
        shared = min(run_prefix, *(len(ids[i]) - 1 for i in run)) if len(run) > 1 else 0
        for i in run:
            group[i] = next_group
            prefix_len[i] = shared
        next_group += 1

    for i in order:
        if run:
            lcp = _common_prefix(ids[run[-1]], ids[i])
            if lcp >= min_prefix and min(run_prefix, lcp) >= min_prefix:
                run_prefix = min(run_prefix, lcp)
                run.append(i)
                continue
            close_run()
        run, run_prefix = [i], len(ids[i])
    if run:
        close_run()

    naive = n_samples * sum(len(s) for s in ids)
    # each distinct prefix is prefilled once, as generation dedups them by their tokens
    distinct_prefixes = {tuple(s[:p]) for s, p in zip(ids, prefix_len)}
    planned = sum(len(p) for p in distinct_prefixes)
    planned += sum(len(s) - p for s, p in zip(ids, prefix_len))
    table = prompts.append_column(
        pa.field("prefix_group", pa.int32(), nullable=False), pa.array(group, pa.int32())
    ).append_column(
        pa.field("prefix_len", pa.int32(), nullable=False), pa.array(prefix_len, pa.int32())
    )
    return PrefixPlan(table, naive, planned)
