"""The update stage: one clipped policy-gradient step on a batch of trainable rollouts.

For every response token t of every sequence::

    ratio_t = exp(logp_t - behaviour_logp_t)
    pg_t    = -min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps) * A)
    kl_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1           (k3 estimator)
    loss    = sum_t (pg_t + kl_coef * kl_t) / (response tokens in the batch)

Token-level aggregation: every token of the batch weighs the same, whichever sequence it
belongs to (DAPO / Dr. GRPO). Sequences are packed into micro-batches of at most
``micro_batch_tokens`` padded tokens and their gradients accumulated, so memory is bounded by
the budget, not by the batch. ``epochs`` > 1 reuses the batch (PPO-style) with the ratio
correcting for the drift.

Off-policy batches (async and replay modes) set ``tis_cap``: the ratio is then taken against
the trainer's own log-probabilities before this update (the proximal policy, recorded at the
first epoch) and each token's loss is weighted by ``min(pi_prox / pi_behaviour, tis_cap)``;
``ops/offpolicy.py`` states the objective and a hand-checkable example.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import torch

from .offpolicy import clipped_pg
from .schema import TRAINABLE, check_columns


@dataclass(frozen=True)
class UpdateParams:
    lr: float = 1e-3
    clip_eps: float = 0.2
    kl_coef: float = 0.0  # > 0 needs a frozen reference model
    temperature: float = 1.0  # the sampling temperature: logprobs must match the behaviour's
    micro_batch_tokens: int = 8192
    max_grad_norm: float = 1.0
    epochs: int = 1
    tis_cap: float | None = None  # off-policy batches: cap of the TIS weight; None: on-policy


def pack_micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of sequences per micro-batch: sorted by length, each micro-batch holding at
    most ``budget`` padded tokens (a longer sequence gets a micro-batch of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and lengths[i] * (len(current) + 1) > budget:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def _collate(prompts, responses, pad_id: int, device):
    """Right-padded [B, T] ids and a [B, T] mask of response positions (the tokens scored)."""
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    scored = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attn[i, : len(p) + len(r)] = 1
        scored[i, len(p) : len(p) + len(r)] = True
    return ids.to(device), attn.to(device), scored.to(device)


def token_logprobs(model, ids: torch.Tensor, attn: torch.Tensor, temperature: float):
    """Log-probability of each token given its prefix: [B, T] (position 0 gets 0)."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)


def _scatter_rows(values: list[list[float]], scored: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(scored.shape, dtype=torch.float32, device=scored.device)
    flat = [v for row in values for v in row]
    out[scored] = torch.tensor(flat, dtype=torch.float32, device=scored.device)
    return out


def update_policy(model, optimizer: torch.optim.Optimizer, trainable: pa.Table,
                  params: UpdateParams, pad_id: int, ref_model=None) -> dict:
    """Run ``params.epochs`` optimizer steps on ``trainable`` (reads ``prompt_ids``,
    ``response_ids``, ``logprobs``, ``advantage``); returns the step's metrics."""
    check_columns(trainable, TRAINABLE, "update_policy")
    if params.kl_coef > 0 and ref_model is None:
        raise ValueError("update_policy: kl_coef > 0 needs a reference model")
    prompts = trainable.column("prompt_ids").to_pylist()
    responses = trainable.column("response_ids").to_pylist()
    behaviour = trainable.column("logprobs").to_pylist()
    advantages = trainable.column("advantage").to_pylist()
    for row, (r, b) in enumerate(zip(responses, behaviour)):
        if len(r) != len(b):
            raise ValueError(
                f"update_policy: row {row} has {len(r)} response tokens but {len(b)} logprobs"
            )
    keep = [i for i, r in enumerate(responses) if r]
    n_tokens = sum(len(responses[i]) for i in keep)
    if n_tokens == 0:
        raise ValueError("update_policy: the batch has no response tokens")
    device = next(model.parameters()).device
    lengths = [len(prompts[i]) + len(responses[i]) for i in keep]
    micro = [[keep[j] for j in mb] for mb in pack_micro_batches(lengths, params.micro_batch_tokens)]
    model.train()
    totals = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "ratio_mean": 0.0}
    if params.tis_cap is not None:
        totals |= {"tis_weight_mean": 0.0, "tis_truncated_frac": 0.0}
    prox: dict[int, torch.Tensor] = {}  # micro-batch -> proximal logprobs [B, T] (epoch 0)
    for _ in range(params.epochs):
        optimizer.zero_grad(set_to_none=True)
        for k, mb in enumerate(micro):
            ids, attn, scored = _collate([prompts[i] for i in mb], [responses[i] for i in mb],
                                         pad_id, device)
            old = _scatter_rows([behaviour[i] for i in mb], scored)  # [B, T]
            adv = torch.tensor([advantages[i] for i in mb], device=device)[:, None]  # [B, 1]
            logp = token_logprobs(model, ids, attn, params.temperature)
            if params.tis_cap is not None and k not in prox:  # no step yet: the trainer's own
                prox[k] = logp.detach()
            terms = clipped_pg(logp, old, adv, params.clip_eps, prox.get(k), params.tis_cap)
            pg = per_token = terms.loss
            if params.kl_coef > 0:
                with torch.no_grad():
                    ref = token_logprobs(ref_model, ids, attn, params.temperature)
                delta = ref - logp
                kl = torch.exp(delta) - delta - 1
                per_token = per_token + params.kl_coef * kl
                totals["kl"] += kl[scored].sum().item() / n_tokens / params.epochs
            loss = per_token[scored].sum() / n_tokens
            loss.backward()
            totals["loss"] += loss.item() / params.epochs
            totals["pg_loss"] += pg[scored].sum().item() / n_tokens / params.epochs
            for key, value in (("clip_frac", terms.clipped), ("ratio_mean", terms.ratio),
                               ("tis_weight_mean", terms.weight),
                               ("tis_truncated_frac", terms.truncated)):
                if key in totals:
                    totals[key] += value[scored].sum().item() / n_tokens / params.epochs
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), params.max_grad_norm)
        optimizer.step()
    model.eval()
    return totals | {
        "grad_norm": float(grad_norm),
        "tokens": n_tokens,
        "micro_batches": len(micro),
    }
