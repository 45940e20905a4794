"""The policy loss of one chunk of sequences, a pure function of its tensors.

For every response token t the loss mask admits (``mask``: [B, T] bool)::

    pg_t  = -w_t * min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps) * A)   (ops/algo/offpolicy)
    kl_t  = exp(ref_t - logp_t) - (ref_t - logp_t) - 1                     (k3 estimator)
    loss  = sum_t (pg_t + kl_coef * kl_t) / n_tokens

``n_tokens`` is the whole batch's count of trained tokens, so that chunk losses, micro-batches
and ranks add up to the batch's token-level mean (``ops/algo/update.py`` drives them). Without
a reference (``ref_logprobs=None``) there is no KL term; without ``tis_cap`` ``w_t = 1`` and the
ratio is taken against the behaviour policy.

Nothing here packs, loops or reduces across ranks: the caller passes the tensors of one chunk
and adds ``LossParts.sums`` to its running metrics.
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
