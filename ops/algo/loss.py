"""The objective, stated once, and the loss of one chunk of sequences as a pure function.

For every response token t the loss mask admits (``mask``: [B, T] bool; multi-turn rows
admit their generated tokens only), with ``A`` the token's advantage (its sequence's, or its
turn's under turn credit: ``ops/algo/advantage.py``)::

    w_t     = min(exp(prox_t - behav_t), tis_cap)                    (no gradient)
    ratio_t = exp(logp_t - prox_t)
    pg_t    = -w_t * min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps) * A)
    kl_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1              (k3 estimator)
    loss    = sum_t (pg_t + kl_coef * kl_t) / n_tokens

``behav_t`` is the log-probability recorded at generation, ``prox_t`` the trainer's own before
this update (the proximal policy), ``logp_t`` the policy being optimised.
As deltas from the papers:

- PPO's clipped surrogate, with GRPO's group-relative advantage and no value model;
- token-level aggregation (DAPO, Dr. GRPO): ``n_tokens`` is the whole batch's count of
  trained tokens, so every token weighs the same whichever sequence it is in, and chunk
  losses, micro-batches and ranks add up to the batch's mean; no per-sequence length term;
- the KL to the reference is the k3 estimator inside the loss (GRPO), 0 by default;
- on-policy (sync mode, ``tis_cap=None``): ``prox = behav``, so ``w_t = 1`` and the ratio is
  taken against the behaviour policy, PPO exactly;
- off-policy (async and replay modes): the decoupled objective (AReaL) with a truncated
  importance weight (TIS, as in verl and Yao et al.), ``ops/algo/offpolicy.py``.

Nothing here packs, loops or reduces across ranks: the caller (``ops/algo/update.py``) passes
the tensors of one chunk and adds ``LossParts.sums`` to its running metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .offpolicy import PGTerms, clipped_pg


@dataclass(frozen=True)
class LossParams:
    """The loss's coefficients (the fields of the same name in ``UpdateParams``)."""

    clip_eps: float = 0.2  # trust region of the ratio
    kl_coef: float = 0.0  # weight of the KL term; used only with ref_logprobs
    tis_cap: float | None = None  # off-policy: cap of the TIS weight; None: on-policy


@dataclass(frozen=True)
class LossParts:
    """One chunk's loss and the per-token terms its metrics are taken from."""

    loss: torch.Tensor  # [] with gradient: sum over the mask of (pg_t + kl_coef * kl_t) / n_tokens
    pg: PGTerms  # [B, T] each: pg_t, ratio, clipped, w_t, truncated
    kl: torch.Tensor | None  # [B, T] kl_t; None without a reference
    mask: torch.Tensor  # [B, T] bool: the tokens the loss trains on

    def sums(self, where: torch.Tensor | None = None) -> dict[str, float]:
        """Sums over the tokens of ``where`` ([B, T] bool, default the loss mask) of each
        per-token term, by metric name: ``pg_loss``, ``kl`` (0 without a reference),
        ``clip_frac``, ``ratio_mean``, ``tis_weight_mean``, ``tis_truncated_frac``."""
        where = self.mask if where is None else where
        terms = {"pg_loss": self.pg.loss, "clip_frac": self.pg.clipped,
                 "ratio_mean": self.pg.ratio, "tis_weight_mean": self.pg.weight,
                 "tis_truncated_frac": self.pg.truncated}
        out = {name: value[where].sum().item() for name, value in terms.items()}
        out["kl"] = 0.0 if self.kl is None else self.kl[where].sum().item()
        return out


def policy_loss(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, ref_logprobs: torch.Tensor | None,
                params: LossParams, n_tokens: int,
                prox_logprobs: torch.Tensor | None = None) -> LossParts:
    """The loss of the module docstring.

    logprobs: [B, T] the policy being optimised (with gradient); behaviour_logprobs: [B, T]
    recorded at generation; advantages: [B, 1] per sequence (or [B, T]); mask: [B, T] bool,
    the tokens trained on (scored and, in multi-turn rollouts, generated); ref_logprobs:
    [B, T] the frozen reference, or None; prox_logprobs: [B, T] the trainer's own before this
    update, required with ``params.tis_cap`` and refused without it (``clipped_pg``)."""
    pg = clipped_pg(logprobs, behaviour_logprobs, advantages, params.clip_eps, prox_logprobs,
                    params.tis_cap)
    per_token, kl = pg.loss, None
    if ref_logprobs is not None:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + params.kl_coef * kl
    return LossParts(per_token[mask].sum() / n_tokens, pg, kl, mask)
