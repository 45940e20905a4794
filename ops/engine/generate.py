"""Generation with the transformers backend: our own decode loop over a HF causal LM.

``generate_rollouts`` turns a shard of prompts into one rollout row per (prompt, sample):

1. *Prefill once.* Each distinct shared prefix of the shard (``prefix_group`` and
   ``prefix_len`` from ``plan_prefixes``) runs through the model once; every prompt then
   prefills only its suffix on top of its prefix's KV cache, in one batch, and the
   resulting cache is repeated for the prompt's n samples. Without a plan, every
   (prompt, sample) is prefilled in full, which is what ``model.generate()`` does.
2. *Decode.* One token per live sequence per step, temperature / top-p sampling (or
   greedy), with the behaviour policy's log-probability of each sampled token. A sequence's
   k-th token is drawn by inverting the CDF at its own uniform (``seeds.uniforms`` of the
   sequence's key and k), so what a (prompt, sample) draws does not depend on its batch.
3. *Leave the batch.* A sequence that emits EOS or reaches ``max_new_tokens`` is removed
   from the batch and from the KV cache at once, so the long tail does not pay for the
   rows that already finished.

Shapes: ``U`` unique prompts, ``B`` live sequences, ``P`` longest shared prefix of the shard,
``S`` longest suffix. Padding sits between a row's prefix and its suffix and is masked; each
row's position ids count only its real tokens, so the result matches unpadded generation.
The recorded log-probabilities are of the behaviour policy, the quantity the trainer
recomputes: the temperature-scaled distribution, renormalised over the top-p nucleus when
``top_p < 1`` (``forward.policy_logprobs``; vLLM's ``processed_logprobs`` are the same).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
from transformers import DynamicCache

from ..data.schema import PROMPTS, check_columns
from .engine_types import SamplingParams, check_limit
from .forward import forward_with_cache, layer_tensors, left_pad, policy_logprobs, positions_of
from .gen_stats import GenerationStats
from .phases import DecodeSpans, record
from .progress import beat
from .rows import expand_samples, prefix_lens_of, rollouts_table, row_keys
from .seeds import index_keys, uniforms


def _prefill_prefixes(model, prefixes: list[list[int]]) -> list[list[tuple]]:
    """KV of each shared prefix, computed once: [prefix][layer] -> (k [1,H,L,D], v)."""
    out = []
    for prefix in prefixes:
        if not prefix:
            out.append([])
            continue
        ids = torch.tensor([prefix], device=model.device)
        cache = DynamicCache(config=model.config)
        forward_with_cache(model, cache, input_ids=ids)
        out.append(layer_tensors(cache))
    return out


def stack_prefix_cache(model, prefix_kv, owner: list[int], prefix_lens: list[int]):
    """Stack each row's prefix KV (the first ``prefix_lens[row]`` positions of
    ``prefix_kv[owner[row]]``), right-aligned to the longest prefix: a cache of [U, H, P, D]
    per layer and its mask [U, P]."""
    width = max(prefix_lens)
    mask = torch.zeros((len(owner), width), dtype=torch.long, device=model.device)
    if width == 0:
        return DynamicCache(config=model.config), mask
    layers = []
    n_layers = len(next(kv for kv in prefix_kv if kv))
    for layer in range(n_layers):
        ref_k, ref_v = next(kv for kv in prefix_kv if kv)[layer]
        k = ref_k.new_zeros((len(owner), ref_k.shape[1], width, ref_k.shape[3]))
        v = ref_v.new_zeros((len(owner), ref_v.shape[1], width, ref_v.shape[3]))
        for row, (p, length) in enumerate(zip(owner, prefix_lens)):
            if length:
                k[row, :, width - length :] = prefix_kv[p][layer][0][0, :, :length]
                v[row, :, width - length :] = prefix_kv[p][layer][1][0, :, :length]
        layers.append((k, v))
    for row, length in enumerate(prefix_lens):
        mask[row, width - length :] = 1 if length else 0
    return DynamicCache(ddp_cache_data=layers, config=model.config), mask


def _sample(logits: torch.Tensor, params: SamplingParams, draws: torch.Tensor | None):
    """logits [B, V] -> (tokens [B], logprobs [B]) under the behaviour policy: the
    temperature-scaled distribution, with ``top_p < 1`` its nucleus renormalised
    (``forward.policy_logprobs``, the trainer's and vLLM's convention), which the token is
    drawn from and its logprob taken of. Greedy: the argmax, with the logprob of the
    temperature-scaled distribution (``top_p`` plays no part). ``draws`` [B]: each row's
    uniform in [0, 1) (unused when greedy)."""
    if params.greedy:
        logp = torch.log_softmax(logits.float() / params.temperature, dim=-1)
        tokens = logp.argmax(dim=-1)
    else:
        logp = policy_logprobs(logits.float(), params.temperature, params.top_p)
        probs = logp.exp()  # 0 outside the nucleus
        cdf = probs.double().cumsum(dim=-1)
        target = draws.to(cdf)[:, None] * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(
            max=cdf.shape[-1] - 1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


@dataclass
class Decoding:
    """A batch being decoded; ``live`` rows map to sequence indices. It can stop part-way
    (``run_decoding(until_finished=...)``) and be resumed, or its unfinished sequences can be
    handed to another worker, which recomputes their prefix (``prefill_continuations``).
    ``tokens`` of a continuation start with those generated before the cut, so that each
    sequence's next draw is numbered by its position in the response."""

    cache: DynamicCache
    logits: torch.Tensor  # [B, V] next-token logits of the live rows
    mask: torch.Tensor  # [B, T] attention mask over the cache
    next_pos: torch.Tensor  # [B] position id of the next token
    live: torch.Tensor  # [B] sequence index of each live row
    budget: torch.Tensor  # [B] tokens each live row may still generate
    tokens: list[list[int]]  # per sequence: generated ids so far
    logprobs: list[list[float]]
    reasons: list[str]  # per sequence: "stop" | "length" (final once it left the batch)
    keys: np.ndarray  # per sequence: its sampling key (uint64, ``seeds.sequence_keys``)

    @property
    def finished_fraction(self) -> float:
        return 1.0 - len(self.live) / max(1, len(self.tokens))

    def results(self) -> list[tuple[list[int], list[float], str]]:
        return list(zip(self.tokens, self.logprobs, self.reasons))

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Narrow the batch to its rows ``keep`` (positions in ``live``): the others leave
        it and the KV cache."""
        self.cache.batch_select_indices(keep)
        self.live, self.mask, self.next_pos = self.live[keep], self.mask[keep], self.next_pos[keep]
        self.budget, self.logits = self.budget[keep], self.logits[keep]


def check_context(model, longest: int) -> None:
    """A ``ValueError`` when ``longest`` tokens exceed the model's context."""
    check_limit(longest, getattr(model.config, "max_position_embeddings", None))


def start_decoding(model, cache, logits, mask, next_pos, budgets: list[int],
                   keys: np.ndarray):
    """The ``Decoding`` of sequences whose prompts were prefilled (``logits``: their last)."""
    n_seq = logits.shape[0]
    if len(keys) != n_seq:
        raise ValueError(f"{len(keys)} sampling keys for {n_seq} sequences")
    return Decoding(
        cache, logits, mask, next_pos, torch.arange(n_seq, device=model.device),
        torch.tensor(budgets, device=model.device), [[] for _ in range(n_seq)],
        [[] for _ in range(n_seq)], ["length"] * n_seq, np.asarray(keys, dtype=np.uint64),
    )


def extend_cache(model, cache: DynamicCache, past_mask: torch.Tensor, past_lens: list[int],
                 suffixes: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Run each row's ``suffixes[i]`` on top of its ``past_lens[i]`` cached tokens (left-padded
    in ``cache`` under ``past_mask`` [B, P]); the suffixes are left-padded too, so padding sits
    between a row's past and its suffix. Returns the last token's logits [B, V] and the mask
    [B, P + S] of the extended cache."""
    suffix_ids, suffix_mask = left_pad(suffixes, pad_id)
    suffix_ids, suffix_mask = suffix_ids.to(model.device), suffix_mask.to(model.device)
    offsets = torch.tensor(past_lens, device=model.device)[:, None]
    positions = (offsets + suffix_mask.cumsum(-1) - 1).clamp(min=0)  # [B, S]
    mask = torch.cat([past_mask, suffix_mask], dim=-1)  # [B, P + S]
    out = forward_with_cache(model, cache, input_ids=suffix_ids, attention_mask=mask,
                             position_ids=positions)
    return out.logits[:, -1], mask


@torch.inference_mode()
def prefill_prompts(model, prompts: list[list[int]], n_samples: int, params: SamplingParams,
                    pad_id: int, prefix_lens: list[int] | None = None,
                    stats: GenerationStats | None = None,
                    keys: np.ndarray | None = None) -> Decoding:
    """Prefill ``n_samples`` copies of each prompt (prompt-major). ``prefix_lens[i]`` tokens
    of prompt i are a prefix shared with other prompts (0 = nothing shared); ``None``
    disables every sharing, the n samples included. ``keys``: each sequence's sampling key
    (``row_keys`` of ``expand_samples``' rows); default: the sequences numbered under
    ``params.seed``."""
    stats = stats if stats is not None else GenerationStats()
    started, t0 = time.perf_counter(), time.time()
    check_context(model, max(len(p) for p in prompts) + params.max_new_tokens)
    if prefix_lens is None:  # no sharing: every sample prefilled on its own
        prompts = [p for p in prompts for _ in range(n_samples)]
        repeat, prefix_lens = 1, [0] * len(prompts)
    else:
        repeat = n_samples
    distinct = {tuple(p[:k]) for p, k in zip(prompts, prefix_lens) if k}
    prefixes = sorted(distinct)
    index = {p: i for i, p in enumerate(prefixes)}
    owner = [index[tuple(p[:k])] if k else -1 for p, k in zip(prompts, prefix_lens)]
    prefix_kv = _prefill_prefixes(model, [list(p) for p in prefixes])
    cache, past_mask = stack_prefix_cache(model, prefix_kv, owner, prefix_lens)

    suffixes = [p[k:] for p, k in zip(prompts, prefix_lens)]
    logits, mask = extend_cache(model, cache, past_mask, prefix_lens, suffixes, pad_id)
    prefilled = sum(len(p) for p in prefixes) + sum(map(len, suffixes))
    reused = repeat * sum(map(len, prompts)) - prefilled
    stats.prefill_tokens += prefilled
    stats.prefill_reused_tokens += reused
    stats.prefill_requests += repeat * len(prompts)
    next_pos = torch.tensor([len(p) for p in prompts], device=model.device)
    if repeat > 1:
        cache.batch_repeat_interleave(repeat)
        logits = logits.repeat_interleave(repeat, dim=0)
        mask = mask.repeat_interleave(repeat, dim=0)
        next_pos = next_pos.repeat_interleave(repeat)
    stats.prefill_seconds += time.perf_counter() - started
    record("prefill", t0, time.time(), tokens=prefilled,
           reused_tokens=reused, requests=repeat * len(prompts))
    n_seq = logits.shape[0]
    return start_decoding(model, cache, logits, mask, next_pos, [params.max_new_tokens] * n_seq,
                  index_keys(params.seed, n_seq) if keys is None else keys)


@torch.inference_mode()
def prefill_continuations(model, cut: pa.Table, params: SamplingParams, pad_id: int,
                          stats: GenerationStats | None = None) -> Decoding:
    """Resume sequences cut elsewhere: prefill prompt + tokens generated so far (the
    recompute side of cut-and-migrate); each may generate up to ``max_new_tokens`` in all.
    Reads ``prompt_ids``, ``partial_ids``, ``partial_logprobs``, and ``prompt_id`` and
    ``sample_idx`` (the sampling keys) of ``cut``; the decoding's tokens start with the
    partial ones."""
    stats = stats if stats is not None else GenerationStats()
    started, t0 = time.perf_counter(), time.time()
    prompts, generated = cut.column("prompt_ids").to_pylist(), cut.column("partial_ids").to_pylist()
    full = [p + g for p, g in zip(prompts, generated)]
    check_context(model, max(len(p) for p in prompts) + params.max_new_tokens)
    ids, mask = left_pad(full, pad_id)
    ids, mask = ids.to(model.device), mask.to(model.device)
    cache = DynamicCache(config=model.config)
    out = forward_with_cache(model, cache, input_ids=ids, attention_mask=mask,
                             position_ids=positions_of(mask))
    stats.prefill_tokens += int(mask.sum())
    stats.prefill_requests += len(full)
    stats.prefill_seconds += time.perf_counter() - started
    record("prefill", t0, time.time(), tokens=int(mask.sum()), requests=len(full))
    next_pos = torch.tensor([len(f) for f in full], device=model.device)
    budgets = [params.max_new_tokens - len(g) for g in generated]
    if min(budgets) < 1:
        raise ValueError("prefill_continuations: a sequence has no token budget left")
    dec = start_decoding(model, cache, out.logits[:, -1], mask, next_pos, budgets,
                 row_keys(params.seed, cut))
    dec.tokens = [list(g) for g in generated]
    dec.logprobs = [list(lp) for lp in cut.column("partial_logprobs").to_pylist()]
    return dec


@torch.inference_mode()
def run_decoding(model, dec: Decoding, params: SamplingParams, eos_id: int,
                 stats: GenerationStats | None = None, until_finished: float = 1.0,
                 on_leave: Callable[[Decoding, torch.Tensor], None] | None = None,
                 pause: Callable[[], bool] | None = None) -> Decoding:
    """Decode until every sequence is done, or until the finished fraction reaches
    ``until_finished`` or ``pause()`` says so after a step (then ``dec`` holds the rest,
    ready to resume). A sequence that
    emits EOS or spends its budget leaves the batch and the KV cache at once; just before,
    ``on_leave(dec, rows)`` sees the batch rows that leave, their cache still in place
    (without their last sampled token, which never ran through the model). Its phases:
    decode spans (``phases.DecodeSpans``) and, where it stops with rows left, a ``pause``."""
    stats = stats if stats is not None else GenerationStats()
    started, spans = time.perf_counter(), DecodeSpans()
    while len(dec.live):
        live = dec.live.tolist()
        tokens, logps = _sample(dec.logits, params, _draws(dec, live, params))
        for seq, tok, lp in zip(live, tokens.tolist(), logps.tolist()):
            dec.tokens[seq].append(tok)
            dec.logprobs[seq].append(lp)
        stats.decode_tokens += len(dec.live)
        stats.decode_steps += 1
        spans.step(len(dec.live))
        beat()  # the stall watch sees this task move
        stopped = tokens == eos_id
        for seq in dec.live[stopped].tolist():
            dec.reasons[seq] = "stop"
        dec.budget = dec.budget - 1
        leaving = stopped | (dec.budget <= 0)
        if on_leave is not None and bool(leaving.any()):
            on_leave(dec, leaving.nonzero().squeeze(-1))
        keep = (~leaving).nonzero().squeeze(-1)
        if len(keep) < len(dec.live):  # finished sequences leave the batch and the cache
            if len(keep) == 0:
                dec.live = keep
                break
            dec.keep_rows(keep)
            tokens = tokens[keep]
        dec.mask = torch.cat([dec.mask, torch.ones_like(dec.mask[:, :1])], dim=-1)
        out = forward_with_cache(model, dec.cache, input_ids=tokens[:, None],
                                 attention_mask=dec.mask, position_ids=dec.next_pos[:, None])
        dec.next_pos = dec.next_pos + 1
        dec.logits = out.logits[:, -1]
        if dec.finished_fraction >= until_finished or (pause is not None and pause()):
            break
    stats.decode_seconds += time.perf_counter() - started
    spans.close()
    if len(dec.live):  # stopped at the rule: the rest wait, paused
        now = time.time()
        record("pause", now, now, live=len(dec.live), finished=dec.finished_fraction,
               by="tau" if dec.finished_fraction >= until_finished else "interrupted")
    return dec


def _draws(dec: Decoding, live: list[int], params: SamplingParams) -> torch.Tensor | None:
    """The uniform of each live sequence's next token (numbered by its response position)."""
    if params.greedy:
        return None
    counters = np.array([len(dec.tokens[s]) for s in live], dtype=np.uint64)
    return torch.from_numpy(uniforms(dec.keys[live], counters)).to(dec.logits.device)


def decode(model, prompts: list[list[int]], n_samples: int, params: SamplingParams,
           eos_id: int, pad_id: int, prefix_lens: list[int] | None = None,
           stats: GenerationStats | None = None,
           keys: np.ndarray | None = None) -> list[tuple[list[int], list[float], str]]:
    """Generate ``n_samples`` continuations of each prompt to the end; returns, prompt-major,
    one ``(token ids, logprobs, finish_reason)`` per (prompt, sample)."""
    dec = prefill_prompts(model, prompts, n_samples, params, pad_id, prefix_lens, stats, keys)
    return run_decoding(model, dec, params, eos_id, stats).results()


def generate_rollouts(model, tokenizer, prompts: pa.Table, n_samples: int,
                      params: SamplingParams, *, policy_version: int, worker: str = "local",
                      share_prefixes: bool = True) -> tuple[pa.Table, GenerationStats]:
    """Rollouts (``schema.ROLLOUTS``, plus any extra prompt columns) for a shard of prompts.

    Reads ``prompt_ids`` and, when ``share_prefixes``, ``prefix_len`` (absent: only the n
    samples share their prompt). Rows come prompt-major: every sample of a prompt together.
    """
    check_columns(prompts, PROMPTS, "generate_rollouts")
    stats = GenerationStats()
    ids = prompts.column("prompt_ids").to_pylist()
    rows = expand_samples(prompts, n_samples)
    start = time.time()
    results = decode(model, ids, n_samples, params, tokenizer.eos_token_id,
                     tokenizer.pad_token_id, prefix_lens_of(prompts, share_prefixes),
                     stats, row_keys(params.seed, rows)) if ids else []
    table = rollouts_table(rows, results, tokenizer,
                           policy_version=policy_version, worker=worker, start=start,
                           end=time.time())
    return table, stats
