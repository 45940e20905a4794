"""A paused tail's decoding state as data: exported on one worker, continued on another.

``run_decoding(until_finished=...)`` leaves a ``Decoding`` paused part-way: a KV cache
over the live rows, the next-token logits, positions, budgets, the tokens and
log-probabilities so far and each sequence's sampling key. ``export_tail`` turns its live
rows into a ``TailKV`` of plain CPU tensors and lists (what Dask moves between workers, pickled with
out-of-band tensor buffers); ``import_tail`` rebuilds a ``Decoding`` from one or more of
them on the receiving engine, which ``run_decoding`` then finishes.

Each row keeps only its real cache positions (``row_kv``: no padding travels); the
receiving side stacks them left-padded to the longest (``generate.stack_prefix_cache``, as the
multi-turn loop does with the KV it keeps across turns), so each row keeps its own position
ids and the continuation equals uninterrupted decoding: token for token under greedy
decoding (float64 leaves no near-ties to flip), and under sampling too: a sequence's draws
are a function of its key and its position (``seeds.py``), whatever batch it continues in.
``recompute_tail`` is the other way to the same ``TailKV``: the receiving worker prefills
the sequences' prompt + tokens so far (the cut rows' ``partial_ids``) itself, so either
path ends in one batch with the tails already there; tails merged from several sources
(``import_tail`` of several) or split over several targets (``take_tail``), or shed in part
by a worker that keeps the rest (``split_tail``), continue as they would have where they
were.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
from transformers import DynamicCache

from .engine_types import SamplingParams
from .gen_stats import GenerationStats
from .generate import Decoding, prefill_continuations, stack_prefix_cache

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys [1, H, T, D], values


def row_kv(cache: DynamicCache, mask: torch.Tensor, row: int) -> KV:
    """The real (unmasked) cache positions of batch row ``row``, per layer, as copies."""
    real = mask[row].bool()
    return [(layer.keys[row : row + 1, :, real].clone(),
             layer.values[row : row + 1, :, real].clone()) for layer in cache.layers]


@dataclass
class TailKV:
    """The unfinished rows of a paused decoding and the rollout rows they belong to."""

    rows: pa.Table  # one rollout row per sequence (``expand_samples`` columns)
    kv: list[KV]  # per sequence: its KV over prompt + generated tokens so far
    logits: torch.Tensor  # [B, V] next-token logits
    next_pos: torch.Tensor  # [B] position id of the next token
    budget: torch.Tensor  # [B] tokens each may still generate
    tokens: list[list[int]]  # per sequence: generated ids so far
    logprobs: list[list[float]]
    keys: np.ndarray  # per sequence: its sampling key (uint64)
    start: float  # wall time the sequences' generation began
    exported_at: float = 0.0  # wall time the export finished (transfer timing starts here)
    export_s: float = 0.0  # seconds the export took

    @property
    def n_sequences(self) -> int:
        return len(self.kv)

    def take(self, positions: list[int]) -> TailKV:
        """``take_tail`` of this tail: the part of it one target gets."""
        return take_tail(self, positions)

    @property
    def context_tokens(self) -> int:
        """Tokens whose KV travels (prompt + generated so far, summed over sequences):
        what the receiving side would prefill again instead."""
        return sum(int(kv[0][0].shape[2]) for kv in self.kv)

    @property
    def nbytes(self) -> int:
        tensors = [t for kv in self.kv for pair in kv for t in pair]
        tensors += [self.logits, self.next_pos, self.budget]
        return sum(t.numel() * t.element_size() for t in tensors) + self.keys.nbytes


def kv_bytes_per_token(model_path: str, element_size: int = 4) -> float:
    """Bytes of one context token's KV cache (keys and values of every layer) for the model
    at ``model_path``, at ``element_size`` bytes per number (4: the fp32 CPU engine)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_path)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return float(2 * cfg.num_hidden_layers * kv_heads * head_dim * element_size)


def export_tail(dec: Decoding, rows: pa.Table, start: float,
                positions: list[int] | None = None) -> TailKV:
    """The live rows of a paused ``dec`` (``rows``: one per sequence of the decoding), or
    those at ``positions`` of its batch, as a ``TailKV`` on the CPU."""
    began = time.perf_counter()
    at = list(range(len(dec.live))) if positions is None else positions
    live = dec.live[at].tolist()
    index = torch.tensor(at, dtype=torch.long, device=dec.live.device)
    cpu = torch.device("cpu")
    kv = [[(k.to(cpu), v.to(cpu)) for k, v in row_kv(dec.cache, dec.mask, r)] for r in at]
    return TailKV(
        rows=rows.take(pa.array(live, pa.int64())), kv=kv, logits=dec.logits[index].to(cpu),
        next_pos=dec.next_pos[index].to(cpu), budget=dec.budget[index].to(cpu),
        tokens=[list(dec.tokens[s]) for s in live], logprobs=[list(dec.logprobs[s]) for s in live],
        keys=dec.keys[live], start=start, exported_at=time.time(),
        export_s=time.perf_counter() - began)


def split_tail(dec: Decoding, rows: pa.Table, start: float, positions: list[int]) -> TailKV:
    """The sequences at ``positions`` of a paused ``dec``'s batch as a ``TailKV``; ``dec``
    keeps the others, paused where they are (a tail shed to another worker)."""
    if not positions or len(set(positions)) < len(positions) \
            or min(positions) < 0 or max(positions) >= len(dec.live):
        raise ValueError(f"split_tail: positions {positions} of a batch of {len(dec.live)}")
    tail = export_tail(dec, rows, start, positions)
    moved = set(positions)
    dec.keep_rows(torch.tensor([p for p in range(len(dec.live)) if p not in moved],
                               dtype=torch.long, device=dec.live.device))
    return tail


def import_tail(model, tails: list[TailKV]) -> tuple[Decoding, pa.Table]:
    """One ``Decoding`` over every sequence of ``tails`` (in order) on ``model``'s device,
    ready for ``run_decoding``, and its rollout rows."""
    if not tails or not any(t.n_sequences for t in tails):
        raise ValueError("import_tail: no sequences to continue")
    device, dtype = model.device, model.dtype
    kv = [[(k.to(device, dtype), v.to(device, dtype)) for k, v in seq]
          for t in tails for seq in t.kv]
    lens = [int(seq[0][0].shape[2]) for seq in kv]
    cache, mask = stack_prefix_cache(model, kv, list(range(len(kv))), lens)
    n = len(kv)
    dec = Decoding(
        cache=cache, logits=torch.cat([t.logits for t in tails]).to(device),
        mask=mask, next_pos=torch.cat([t.next_pos for t in tails]).to(device),
        live=torch.arange(n, device=device), budget=torch.cat([t.budget for t in tails]).to(device),
        tokens=[list(x) for t in tails for x in t.tokens],
        logprobs=[list(x) for t in tails for x in t.logprobs],
        reasons=["length"] * n, keys=np.concatenate([t.keys for t in tails]))
    rows = pa.concat_tables([t.rows for t in tails if t.n_sequences])
    return dec, rows


def take_tail(tail: TailKV, positions: list[int]) -> TailKV:
    """The sequences at ``positions`` of ``tail`` (in that order) as a tail of their own: a
    tail split over several targets."""
    if not positions or min(positions) < 0 or max(positions) >= tail.n_sequences:
        raise ValueError(f"take_tail: positions {positions} of a tail of {tail.n_sequences}")
    index = torch.tensor(positions, dtype=torch.long)
    return TailKV(
        rows=tail.rows.take(pa.array(positions, pa.int64())),
        kv=[tail.kv[p] for p in positions], logits=tail.logits[index].clone(),
        next_pos=tail.next_pos[index].clone(), budget=tail.budget[index].clone(),
        tokens=[tail.tokens[p] for p in positions],
        logprobs=[tail.logprobs[p] for p in positions], keys=tail.keys[positions],
        start=tail.start, exported_at=tail.exported_at, export_s=tail.export_s)


def recompute_tail(model, cut: pa.Table, params: SamplingParams, pad_id: int,
                   stats: GenerationStats | None = None) -> TailKV:
    """A ``TailKV`` of cut sequences made here by recomputing their context: reads
    ``prompt_ids``, ``partial_ids`` and ``partial_logprobs`` (tokens so far), ``prompt_id``
    and ``sample_idx`` of ``cut``."""
    dec = prefill_continuations(model, cut, params, pad_id, stats)
    return export_tail(dec, cut.drop_columns(["partial_ids", "partial_logprobs"]), time.time())
