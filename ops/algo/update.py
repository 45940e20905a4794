"""The update stage: ``epochs`` clipped policy-gradient steps on a batch of trainable rollouts.

The objective is ``ops/algo/loss.py``'s (stated there once); this module drives it: it
reads and checks the batch (``read_batch``), packs it, runs the forward and backward passes,
the epochs and the ranks' all-reduce, and keeps the metrics (``LossTotals``).

Multi-turn rollouts carry a ``loss_mask``: the sums then run over generated tokens only, and
observation tokens (whose ``logprobs`` are placeholders) add no term to the loss or the KL.

Sequences are packed into micro-batches of at most
``micro_batch_tokens`` padded tokens and their gradients accumulated, so memory is bounded by
the budget, not by the batch. The samples of a group share their prompt's forward pass
(``response_logprobs``), as generation shares its prefill: with n samples per prompt the
update runs each prompt once, not n times (``forward_tokens`` vs ``forward_tokens_naive``).
The loss is taken per length chunk, each chunk's backward right after its forward
(``backward_logprobs``); with FSDP2 ranks every rank runs the same passes
(``padding_passes``: the zero-loss passes added for that, over the ranks).
``epochs`` > 1 reuses the batch (PPO-style) with the ratio correcting for the drift.

A step whose loss or gradient norm is not finite (NaN or infinite, on any rank: the ranks
agree by a sum) is not taken: the gradients are dropped, ``optimizer.step`` is not called
and the remaining epochs are not run; the metrics say so (``nonfinite_update`` = 1, the loss
and gradient norm as they were) and the driver decides (``nonfinite_policy``). With
``epochs`` = 1 the weights and optimizer state are then exactly those before the batch.

Off-policy batches (async and replay modes) set ``tis_cap``: the proximal logprobs are the
trainer's own at the first epoch. The weights of the rows generated before the batch's
newest version (the replayed rows, in the replay modes) are reported apart as well
(``tis_weight_mean_older``, ``tis_truncated_frac_older``, over ``older_token_frac`` of the
tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from ..data.schema import TRAINABLE, check_columns
from ..engine.forward import backward_logprobs, chunk_passes, response_logprobs
from .advantage import count_turns, turn_of_tokens
from .loss import LossParams, policy_loss
from .parallel import (
    Ranks,
    agree_passes,
    all_reduce_sum,
    full_tensor,
    idle_micro_batch,
    inner,
    split_rows,
    sync_gradients,
)


@dataclass(frozen=True)
class UpdateParams:
    lr: float = 1e-3
    clip_eps: float = 0.2
    kl_coef: float = 0.0  # > 0 needs a frozen reference model
    temperature: float = 1.0  # the sampling temperature: logprobs must match the behaviour's
    top_p: float = 1.0  # the sampling nucleus: logprobs are renormalised over it, as behaviour's
    micro_batch_tokens: int = 8192
    max_grad_norm: float = 1.0
    epochs: int = 1
    tis_cap: float | None = None  # off-policy batches: cap of the TIS weight; None: on-policy

    @property
    def loss_params(self) -> LossParams:
        """The coefficients ``policy_loss`` reads."""
        return LossParams(self.clip_eps, self.kl_coef, self.tis_cap)


def pack_micro_batches(prompts: list[list[int]], response_lens: list[int],
                       budget: int) -> list[list[int]]:
    """Row indices per micro-batch. Rows with the same prompt (the samples of a group) go
    together, since ``response_logprobs`` computes a prompt once per micro-batch. Groups are
    taken in order of their longest response and packed while the micro-batch's padded
    tokens, distinct prompts × longest prompt + rows × longest response, stay within
    ``budget``; a group over the budget by itself is split, and a row over it by itself gets
    a micro-batch of its own."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt), []).append(i)
    units: list[list[int]] = []
    for prompt, rows in groups.items():
        chunk: list[int] = []
        for i in sorted(rows, key=lambda i: response_lens[i]):
            if chunk and len(prompt) + (len(chunk) + 1) * response_lens[i] > budget:
                units.append(chunk)
                chunk = []
            chunk.append(i)
        units.append(chunk)
    units.sort(key=lambda u: (response_lens[u[-1]], len(prompts[u[0]])))
    batches: list[list[int]] = []
    current: list[int] = []
    n_prompts = longest_prompt = longest_response = 0
    for unit in units:
        p, r = len(prompts[unit[0]]), response_lens[unit[-1]]
        cost = ((n_prompts + 1) * max(longest_prompt, p)
                + (len(current) + len(unit)) * max(longest_response, r))
        if current and cost > budget:
            batches.append(current)
            current, n_prompts, longest_prompt, longest_response = [], 0, 0, 0
        current += unit
        n_prompts += 1
        longest_prompt, longest_response = max(longest_prompt, p), max(longest_response, r)
    if current:
        batches.append(current)
    return batches


def _scatter_rows(values: list[list[float]], scored: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(scored.shape, dtype=torch.float32, device=scored.device)
    flat = [v for row in values for v in row]
    out[scored] = torch.tensor(flat, dtype=torch.float32, device=scored.device)
    return out


def loss_masks(trainable: pa.Table) -> list[list[int]] | None:
    """Per row, 1 for each response token the loss trains on (``loss_mask`` of multi-turn
    rollouts, ``schema.EPISODES``); None when the table has no such column (every token)."""
    if "loss_mask" not in trainable.column_names:
        return None
    masks = trainable.column("loss_mask").to_pylist()
    for row, (m, r) in enumerate(zip(masks, trainable.column("response_ids").to_pylist())):
        if len(m) != len(r):
            raise ValueError(f"update_policy: row {row} has {len(r)} response tokens but "
                             f"{len(m)} loss-mask entries")
    return masks


def token_advantages(trainable: pa.Table,
                     masks: list[list[int]] | None) -> list[list[float]] | None:
    """Per row, each response token's advantage from ``turn_advantage`` (one per run of
    generated tokens, ``ops/algo/advantage.py`` turn credit; observation tokens 0); None
    when the table has no such column (one advantage per sequence)."""
    if "turn_advantage" not in trainable.column_names:
        return None
    if masks is None:
        raise ValueError("update_policy: turn_advantage needs the episodes' loss_mask")
    out = []
    for row, (mask, per_turn) in enumerate(zip(masks, trainable.column("turn_advantage")
                                               .to_pylist())):
        turn = turn_of_tokens(mask)
        if count_turns(turn) != len(per_turn):
            raise ValueError(f"update_policy: row {row} has {count_turns(turn)} generated "
                             f"turns but {len(per_turn)} turn advantages")
        out.append([per_turn[k] if m == 1 else 0.0 for k, m in zip(turn, mask)])
    return out


class EpisodesFailed(ValueError):
    """Every episode of a batch failed in its environment: nothing to train on. The message
    quotes the first environment error (a misspelt ``env_kwargs`` key, a first observation
    over the token budget ...), which is the user's to fix."""


def _raise_if_every_episode_failed(trainable: pa.Table) -> None:
    if "env_error" not in trainable.column_names or not len(trainable):
        return
    finish = trainable.column("finish_reason").to_pylist()
    errors = trainable.column("env_error").to_pylist()
    if all(f == "error" for f in finish):
        first = next((e for e in errors if e), "no error recorded")
        raise EpisodesFailed(f"every episode of the batch failed in its environment "
                             f"({len(finish)} of {len(finish)}); the first: {first}")


@dataclass
class Batch:
    """The columns of a trainable table the update reads, checked: per row its prompt,
    response, behaviour logprobs and advantage, the loss mask and per-token advantages of
    multi-turn rows (None: every token, one advantage per sequence)."""

    prompts: list[list[int]]
    responses: list[list[int]]
    behaviour: list[list[float]]
    advantages: list[float]
    masks: list[list[int]] | None
    per_token: list[list[float]] | None
    older: np.ndarray | None  # rows behind the batch's newest version (off-policy batches)
    n_tokens: int  # the whole batch's trained tokens: what the loss divides by

    def rows(self, idx: list[int], scored: torch.Tensor):
        """(behaviour logprobs, advantages, the tokens the loss trains) of rows ``idx``, as
        [b, r] tensors on ``scored``'s grid (``scored``: the response tokens)."""
        old = _scatter_rows([self.behaviour[i] for i in idx], scored)
        if self.per_token is None:
            adv = torch.tensor([self.advantages[i] for i in idx], device=scored.device)[:, None]
        else:  # turn credit: each turn's tokens their turn's advantage
            adv = _scatter_rows([self.per_token[i] for i in idx], scored)
        if self.masks:  # multi-turn: observation tokens take no part in the loss
            scored = scored & (_scatter_rows([self.masks[i] for i in idx], scored) > 0)
        return old, adv, scored


def read_batch(trainable: pa.Table, params: UpdateParams) -> Batch:
    """``trainable``'s columns as a ``Batch``; ``ValueError`` (one line) for what no update
    can take: missing columns, mismatched lengths, no response token."""
    check_columns(trainable, TRAINABLE, "update_policy")
    responses = trainable.column("response_ids").to_pylist()
    behaviour = trainable.column("logprobs").to_pylist()
    for row, (r, b) in enumerate(zip(responses, behaviour)):
        if len(r) != len(b):
            raise ValueError(
                f"update_policy: row {row} has {len(r)} response tokens but {len(b)} logprobs"
            )
    masks = loss_masks(trainable)
    per_token = token_advantages(trainable, masks)
    _raise_if_every_episode_failed(trainable)
    n_tokens = (sum(sum(m) for m in masks) if masks else sum(map(len, responses)))
    if n_tokens == 0:
        raise ValueError("update_policy: the batch has no response tokens")
    older = None
    if params.tis_cap is not None:
        version = trainable.column("policy_version").to_numpy()
        older = version < version.max()
    return Batch(trainable.column("prompt_ids").to_pylist(), responses, behaviour,
                 trainable.column("advantage").to_pylist(), masks, per_token, older, n_tokens)


class LossTotals:
    """The update's running metrics: the loss and each per-token term summed over the
    chunks of every epoch (as batch means), and with TIS the older rows' terms apart."""

    def __init__(self, n_tokens: int, epochs: int, tis: bool) -> None:
        self.n_tokens, self.epochs, self.tis = n_tokens, epochs, tis
        self.sums = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "clip_frac": 0.0,
                     "ratio_mean": 0.0}
        if tis:
            self.sums |= {"tis_weight_mean": 0.0, "tis_truncated_frac": 0.0}
        self.older = {"tis_weight_mean_older": 0.0, "tis_truncated_frac_older": 0.0,
                      "older_tokens": 0.0}

    def add(self, parts, older_tokens: torch.Tensor | None) -> None:
        """A chunk's ``LossParts``; ``older_tokens``: its trained tokens of older rows."""
        self.sums["loss"] += parts.loss.item() / self.epochs
        for name, value in parts.sums().items():
            if name in self.sums:
                self.sums[name] += value / self.n_tokens / self.epochs
        if older_tokens is not None:
            self.older["older_tokens"] += older_tokens.sum().item() / self.epochs
            for name, value in parts.sums(older_tokens).items():
                if name + "_older" in self.older:
                    self.older[name + "_older"] += value / self.epochs


def _chunk_loss(batch: Batch, mb: list[int], ref: torch.Tensor | None, params: UpdateParams,
                prox: dict, totals: LossTotals, scale: float):
    """The loss callback of micro-batch ``mb`` for ``backward_logprobs``: the loss of its
    rows ``rows`` (``ref``: their reference logprobs), added to ``totals``. The proximal
    logprobs of off-policy batches are the trainer's own at the first epoch (``prox``)."""

    def loss(rows: list[int], logp: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
        idx = [mb[j] for j in rows]
        old, adv, scored = batch.rows(idx, scored)
        key = tuple(idx)
        if params.tis_cap is not None and key not in prox:  # no step yet: own logps
            prox[key] = logp.detach()
        parts = policy_loss(logp, old, adv, scored,
                            None if ref is None else ref[rows, :logp.shape[1]],
                            params.loss_params, batch.n_tokens, prox.get(key))
        older = (None if batch.older is None else
                 scored & torch.tensor(batch.older[idx], device=scored.device)[:, None])
        totals.add(parts, older)
        return parts.loss * scale

    return loss


def _is_finite_step(grad_norm: torch.Tensor, loss: float, ranks: Ranks | None,
                    device: torch.device) -> bool:
    """Whether the step's loss and gradient norm are finite, on every rank."""
    finite = math.isfinite(float(full_tensor(grad_norm))) and math.isfinite(loss)
    if ranks is not None:  # this rank's share of the loss: every rank must agree
        return all_reduce_sum({"nonfinite": float(not finite)}, device)["nonfinite"] == 0
    return finite


def _micro_batches(batch: Batch, budget: int,
                   ranks: Ranks | None) -> tuple[list[int], list[list[int]]]:
    """(the rows this process trains, packed into micro-batches of rows): the rows with a
    response, and under ``ranks`` this rank's groups of them (``split_rows``)."""
    keep = [i for i, r in enumerate(batch.responses) if r]
    if ranks is not None:  # the loss still divides by the whole batch's tokens
        share = split_rows([batch.prompts[i] for i in keep],
                           [len(batch.responses[i]) for i in keep], ranks.world)[ranks.rank]
        keep = [keep[j] for j in share]
    packed = pack_micro_batches([batch.prompts[i] for i in keep],
                                [len(batch.responses[i]) for i in keep], budget)
    return keep, [[keep[j] for j in mb] for mb in packed]


def update_policy(model, optimizer: torch.optim.Optimizer, trainable: pa.Table,
                  params: UpdateParams, pad_id: int, ref_model=None,
                  ranks: Ranks | None = None) -> dict:
    """Run ``params.epochs`` optimizer steps on ``trainable`` (reads ``prompt_ids``,
    ``response_ids``, ``logprobs``, ``advantage``); returns the step's metrics.

    ``ranks``: ``model`` is wrapped for that process group (``ops/algo/parallel.py``); every rank
    gets the whole ``trainable``, runs its share of the groups (``split_rows``) and the
    metrics are the whole batch's."""
    batch = read_batch(trainable, params)
    if params.kl_coef > 0 and ref_model is None:
        raise ValueError("update_policy: kl_coef > 0 needs a reference model")
    prompts, responses = batch.prompts, batch.responses
    keep, micro = _micro_batches(batch, params.micro_batch_tokens, ranks)
    forward, model = model, inner(model)  # forward passes skip a DDP wrapper
    device = next(model.parameters()).device
    model.train()
    totals = LossTotals(batch.n_tokens, params.epochs, params.tis_cap is not None)
    prox: dict[tuple[int, ...], torch.Tensor] = {}  # chunk's rows -> proximal logprobs
    chunks = [chunk_passes(model, [responses[i] for i in mb]) for mb in micro]
    passes = chunks  # every rank runs the same passes (ops/algo/parallel.py)
    if ranks is not None and ranks.parallel == "fsdp":
        passes = agree_passes(chunks, device)
    scale = 1.0 if ranks is None else ranks.loss_scale
    finite = True
    for _ in range(params.epochs):
        optimizer.zero_grad(set_to_none=True)
        loss_before = totals.sums["loss"]
        for k, agreed in enumerate(passes):
            if k >= len(micro):
                idle_micro_batch(model, pad_id, agreed)
                continue
            mb_prompts = [prompts[i] for i in micro[k]]
            mb_responses = [responses[i] for i in micro[k]]
            ref = None
            if params.kl_coef > 0:
                with torch.no_grad():
                    ref, _ = response_logprobs(ref_model, mb_prompts, mb_responses, pad_id,
                                               params.temperature, params.top_p)
            backward_logprobs(model, mb_prompts, mb_responses, pad_id, params.temperature,
                              _chunk_loss(batch, micro[k], ref, params, prox, totals, scale),
                              pad_passes=agreed - chunks[k], top_p=params.top_p)
        if ranks is not None:
            sync_gradients(forward, pad_id)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), params.max_grad_norm)
        finite = _is_finite_step(grad_norm, totals.sums["loss"] - loss_before, ranks, device)
        if not finite:  # the weights stay as they are: no step, no further epoch
            optimizer.zero_grad(set_to_none=True)
            break
        optimizer.step()
    model.eval()
    padding = params.epochs * (sum(a - c for a, c in zip(passes, chunks))
                               + sum(1 + a for a in passes[len(micro):]))
    local = {"micro_batches": len(micro),
             "forward_tokens": sum(sum(map(len, {tuple(prompts[i]) for i in mb}))
                                   for mb in micro),
             "forward_tokens_naive": sum(len(prompts[i]) for i in keep),
             "padding_passes": padding}
    return (_batch_metrics(totals, local, ranks, device)
            | {"grad_norm": float(full_tensor(grad_norm)), "tokens": batch.n_tokens,
               "nonfinite_update": float(not finite)})


def _batch_metrics(totals: LossTotals, local: dict, ranks: Ranks | None,
                   device: torch.device) -> dict:
    """The whole batch's loss terms and counts (over every rank's share); the forward token
    counts include the batch's trained tokens."""
    sums = totals.sums
    if ranks is not None:
        summed = all_reduce_sum(sums | local, device)
        sums, local = {k: summed[k] for k in sums}, {k: int(summed[k]) for k in local}
    counts = {k: v + (totals.n_tokens if k.startswith("forward_tokens") else 0)
              for k, v in local.items()}
    if totals.tis:
        sums = sums | older_summary(totals.older, totals.n_tokens, device, ranks)
    return sums | counts


def older_summary(sums: dict[str, float], n_tokens: int, device: torch.device,
                  ranks: Ranks | None) -> dict[str, float]:
    """Means over the older rows' tokens from their sums (over every rank's share)."""
    if ranks is not None:
        sums = all_reduce_sum(sums, device)
    tokens = sums["older_tokens"]
    return {"older_token_frac": tokens / n_tokens,
            "tis_weight_mean_older": sums["tis_weight_mean_older"] / tokens if tokens else 0.0,
            "tis_truncated_frac_older": (sums["tis_truncated_frac_older"] / tokens
                                         if tokens else 0.0)}
