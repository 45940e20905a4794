"""``HFBackend.decode_turns``: one turn of many conversations as one batch of our decode loop.

Each conversation keeps its KV cache between turns (``Turn.cache``: its real positions,
per layer ``[1, H, T, D]``): when a sequence leaves the batch (EOS or its budget), its rows of
the cache are kept; the next turn stacks the kept caches, left-padded to the longest, and
runs only what the model has not seen (the previous turn's last token and the observation:
``generate.extend_cache``). Without ``keep_cache`` every turn prefills the whole
conversation again, which ``bench/multiturn.py`` compares against (same tokens in float64).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from .engine_types import SamplingParams, Turn
from .gen_stats import GenerationStats
from .generate import Decoding, extend_cache, run_decoding, stack_prefix_cache, start_decoding
from .kv_transfer import row_kv


def _cached_len(turn: Turn) -> int:
    return turn.cache[0][0].shape[2] if turn.cache else 0


@torch.inference_mode()
def decode_turns(model, tokenizer, turns: list[Turn], params: SamplingParams,
                 stats: GenerationStats, *, keep_cache: bool = True,
                 on_leave: Callable[[int, list[int]], None] | None = None) -> None:
    """The protocol's ``decode_turns`` on ``model`` (see the module docstring)."""
    if not turns:
        return
    started = time.perf_counter()
    if not keep_cache:
        for turn in turns:
            turn.cache = None
    past = [_cached_len(t) for t in turns]
    pending = [t.context[p:] for t, p in zip(turns, past)]
    cache, past_mask = stack_prefix_cache(model, [t.cache or [] for t in turns],
                                          list(range(len(turns))), past)
    logits, mask = extend_cache(model, cache, past_mask, past, pending, tokenizer.pad_token_id)
    stats.prefill_tokens += sum(map(len, pending))
    next_pos = torch.tensor([p + len(s) for p, s in zip(past, pending)], device=model.device)
    keys = np.array([t.key for t in turns], dtype=np.uint64)
    dec = start_decoding(model, cache, logits, mask, next_pos, [t.budget for t in turns], keys)
    stats.prefill_seconds += time.perf_counter() - started

    def leave(d: Decoding, rows: torch.Tensor) -> None:
        for row in rows.tolist():
            seq = int(d.live[row])
            if keep_cache:
                turns[seq].cache = row_kv(d.cache, d.mask, row)
            if on_leave is not None:
                on_leave(seq, list(d.tokens[seq]))

    run_decoding(model, dec, params, tokenizer.eos_token_id, stats, on_leave=leave)
    for turn, result in zip(turns, dec.results()):
        turn.result = result
