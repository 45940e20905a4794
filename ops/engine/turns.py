"""``HFBackend.decode_turns``: one turn of many conversations as one batch of our decode loop.

Each conversation keeps its KV cache between turns (``Turn.cache``, a ``KeptKV``: the ids
it covers and its real positions, per layer ``[1, H, T, D]``): when a sequence leaves the
batch (EOS or its budget), its rows of the cache are kept; the next turn stacks the kept
caches, left-padded to the longest, and runs only what the model has not seen
(``generate.extend_cache``): the context after the longest prefix it shares with the kept
ids, at least its last token (whose logits start the turn). A multi-turn episode's next
context extends the kept ids, so only the previous turn's last token and the observation
run; an agent's request that re-renders part of its history runs from where it departs
(positions past that are dropped: causal attention keeps a prefix's KV valid on its own).
``GenerationStats.prefill_reused_tokens`` counts the kept tokens a turn did not run again.
Without ``keep_cache`` every turn prefills the whole conversation again, which
``bench/multiturn.py`` compares against (same tokens in float64).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .engine_types import SamplingParams, Turn
from .gen_stats import GenerationStats
from .generate import Decoding, extend_cache, run_decoding, stack_prefix_cache, start_decoding
from .kv_transfer import KV, row_kv
from .phases import record


@dataclass
class KeptKV:
    """A conversation's KV kept for its next turn: the token ids it covers, and per layer
    its keys and values over them (``row_kv``)."""

    ids: list[int]
    kv: KV


def reusable(turn: Turn) -> int:
    """How many of the turn's context tokens its kept KV holds already: the longest prefix
    the context shares with the kept ids, leaving the context's last token to run."""
    kept = turn.cache
    if not isinstance(kept, KeptKV):
        return 0
    limit = min(len(kept.ids), len(turn.context) - 1)
    same = np.asarray(kept.ids[:limit]) != np.asarray(turn.context[:limit])
    return int(same.argmax()) if same.any() else limit


@torch.inference_mode()
def decode_turns(model, tokenizer, turns: list[Turn], params: SamplingParams,
                 stats: GenerationStats, *, keep_cache: bool = True,
                 on_leave: Callable[[int, list[int]], None] | None = None) -> None:
    """The protocol's ``decode_turns`` on ``model`` (see the module docstring)."""
    if not turns:
        return
    started, t0 = time.perf_counter(), time.time()
    if not keep_cache:
        for turn in turns:
            turn.cache = None
    past = [reusable(t) for t in turns]
    pending = [t.context[p:] for t, p in zip(turns, past)]
    cache, past_mask = stack_prefix_cache(model, [t.cache.kv if p else [] for t, p in
                                                  zip(turns, past)],
                                          list(range(len(turns))), past)
    logits, mask = extend_cache(model, cache, past_mask, past, pending, tokenizer.pad_token_id)
    stats.prefill_tokens += sum(map(len, pending))
    stats.prefill_reused_tokens += sum(past)
    stats.prefill_requests += len(turns)
    next_pos = torch.tensor([p + len(s) for p, s in zip(past, pending)], device=model.device)
    keys = np.array([t.key for t in turns], dtype=np.uint64)
    dec = start_decoding(model, cache, logits, mask, next_pos, [t.budget for t in turns], keys)
    stats.prefill_seconds += time.perf_counter() - started
    record("prefill", t0, time.time(), tokens=sum(map(len, pending)), reused_tokens=sum(past),
           requests=len(turns))

    def leave(d: Decoding, rows: torch.Tensor) -> None:
        for row in rows.tolist():
            seq = int(d.live[row])
            if keep_cache:  # the cache holds all but the last sampled token
                turns[seq].cache = KeptKV(turns[seq].context + d.tokens[seq][:-1],
                                          row_kv(d.cache, d.mask, row))
            turns[seq].result = (d.tokens[seq], d.logprobs[seq], d.reasons[seq])
            if on_leave is not None:
                on_leave(seq, list(d.tokens[seq]))

    run_decoding(model, dec, params, tokenizer.eos_token_id, stats, on_leave=leave)
