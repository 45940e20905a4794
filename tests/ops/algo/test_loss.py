"""The policy loss against a case worked by hand: clipping on both sides, the k3 KL, the loss
mask, the batch-wide token count, the gradient, and TIS weights with their metric sums."""

from __future__ import annotations

import math

import pytest
import torch

from rlhfless.ops.algo.loss import LossParams, policy_loss

log = math.log


def test_clipped_pg_plus_kl_over_the_masked_tokens_of_the_batch():
    # two sequences, two tokens each; behaviour p = 0.5 everywhere; eps = 0.1
    behaviour = torch.full((2, 2), log(0.5))
    logp = torch.tensor([[log(0.6), log(0.4)],  # ratios 1.2 and 0.8: both outside [0.9, 1.1]
                         [log(0.5), log(0.3)]]).requires_grad_(True)  # 1.0; 0.6 (masked)
    adv = torch.tensor([[1.0], [-1.0]])
    mask = torch.tensor([[True, True], [True, False]])
    # ref - logp: ln 2 at [0, 0] (kl = 2 - ln 2 - 1 = 1 - ln 2), 0 elsewhere, ln 3 masked
    ref = logp.detach() + torch.tensor([[log(2.0), 0.0], [0.0, log(3.0)]])
    parts = policy_loss(logp, behaviour, adv, mask, ref, LossParams(0.1, 0.5), n_tokens=6)
    # pg: A = 1, ratio 1.2 -> -min(1.2, 1.1) = -1.1;  A = 1, ratio 0.8 -> -min(0.8, 0.9) = -0.8;
    #     A = -1, ratio 1 -> -min(-1, -1) = 1.   Sum -0.9.
    # loss = (-0.9 + 0.5 * (1 - ln 2)) / 6: six tokens in the batch, three in this chunk
    expected = (-0.9 + 0.5 * (1 - log(2.0))) / 6
    torch.testing.assert_close(parts.loss, torch.tensor(expected))
    sums = parts.sums()
    assert sums["pg_loss"] == pytest.approx(-0.9, abs=1e-6)
    assert sums["kl"] == pytest.approx(1 - log(2.0), abs=1e-6)
    assert sums["clip_frac"] == 2  # both tokens of the first row; the masked one is not counted
    assert sums["ratio_mean"] == pytest.approx(3.0, abs=1e-6)  # 1.2 + 0.8 + 1
    assert sums["tis_weight_mean"] == 3 and sums["tis_truncated_frac"] == 0  # on-policy: w = 1
    parts.loss.backward()
    # d/dlogp, each over 6: [0, 0] the clipped branch is constant, kl gives 0.5 * (1 - 2) = -0.5;
    # [0, 1] the ratio branch, -ratio * A = -0.8; [1, 0] -ratio * A = 1; [1, 1] masked, 0
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, -0.8], [1.0, 0.0]]) / 6)


def test_without_a_reference_there_is_no_kl_whatever_the_coefficient():
    logp = torch.tensor([[log(0.6)]])
    parts = policy_loss(logp, torch.tensor([[log(0.5)]]), torch.tensor([[1.0]]),
                        torch.tensor([[True]]), None, LossParams(0.2, 0.5), n_tokens=1)
    assert parts.kl is None and parts.sums()["kl"] == 0
    torch.testing.assert_close(parts.loss, torch.tensor(-1.2))  # ratio 1.2 inside [0.8, 1.2]


def test_tis_weights_the_tokens_and_sums_follow_any_subset():
    behaviour = torch.tensor([[log(0.2), log(0.4)]])
    prox = torch.tensor([[log(0.5), log(0.5)]])
    logp = prox.clone()  # first step: ratio 1
    mask = torch.tensor([[True, True]])
    parts = policy_loss(logp, behaviour, torch.tensor([[1.0]]), mask, None,
                        LossParams(0.2, 0.0, tis_cap=2.0), n_tokens=2, prox_logprobs=prox)
    # w = min(0.5 / 0.2, 2) = 2 (truncated) and 0.5 / 0.4 = 1.25: loss (-2 - 1.25) / 2
    torch.testing.assert_close(parts.loss, torch.tensor(-1.625))
    assert parts.sums()["tis_weight_mean"] == pytest.approx(3.25)
    assert parts.sums()["tis_truncated_frac"] == 1
    first = torch.tensor([[True, False]])
    assert parts.sums(first)["tis_weight_mean"] == pytest.approx(2.0)
    assert parts.sums(first)["pg_loss"] == pytest.approx(-2.0)
    with pytest.raises(ValueError, match="needs the proximal"):
        policy_loss(logp, behaviour, torch.tensor([[1.0]]), mask, None,
                    LossParams(0.2, 0.0, tis_cap=2.0), n_tokens=2)
