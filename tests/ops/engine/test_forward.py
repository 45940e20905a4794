"""Tests of the behaviour policy's log-probabilities (``policy_logprobs``, ``token_logprobs``):
the top-p nucleus checked by hand on a four-token vocabulary, top_p = 1 left exactly as it
was, the gradient through the kept logits, and the floor of a token outside the nucleus.

Tolerances: the hand-computed values are float64 logs of exact ratios; the helper works in
float32 on logits of magnitude < 7, whose softmax and log carry a few float32 ulps (~1e-7
relative, values below ~3): 1e-6 is an order above that.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlhfless.ops.algo.loss import LossParams, policy_loss
from rlhfless.ops.engine.forward import (
    LOGPROB_FLOOR,
    nucleus_mask,
    policy_logprobs,
    token_logprobs,
)

# probabilities of a four-token vocabulary, out of order so the mask must be scattered back
PROBS = [0.05, 0.5, 0.15, 0.3]
TEMPERATURE = 2.0
ATOL = 1e-6


def logits() -> torch.Tensor:
    """[1, 4] logits whose softmax at TEMPERATURE is PROBS."""
    return TEMPERATURE * torch.tensor([PROBS]).log()


@pytest.mark.parametrize(("top_p", "kept"), [
    (0.45, [1]),  # 0.5 alone already holds 0.45
    (0.6, [1, 3]),  # 0.5 < 0.6: the boundary token 0.3 that brings the mass to 0.8 is kept
    (0.85, [1, 3, 2]),  # 0.5 + 0.3 = 0.8 < 0.85: 0.15 is kept, 0.05 (above it 0.95) is not
    (0.99, [1, 3, 2, 0]),  # above 0.05 are 0.95 < 0.99: every token
])
def test_nucleus_renormalised_by_hand(top_p, kept):
    mass = sum(PROBS[i] for i in kept)
    want = torch.tensor([[math.log(PROBS[i] / mass) if i in kept else -math.inf
                          for i in range(4)]], dtype=torch.float64)
    got = policy_logprobs(logits(), TEMPERATURE, top_p)
    assert nucleus_mask(logits() / TEMPERATURE, top_p).tolist() == [
        [i not in kept for i in range(4)]]
    torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=0)


def test_top_p_one_is_the_log_softmax_bit_for_bit():
    x = torch.randn(3, 5, 97, generator=torch.Generator().manual_seed(0)) * 4
    tokens = torch.randint(0, 97, (3, 5), generator=torch.Generator().manual_seed(1))
    full = torch.log_softmax(x / 0.7, dim=-1)
    assert torch.equal(policy_logprobs(x, 0.7), full)
    assert torch.equal(token_logprobs(x, tokens, 0.7), full.gather(-1, tokens[..., None])[..., 0])


def test_gradient_flows_through_the_kept_logits_only():
    """d logp(token) / d logits = (onehot(token) - nucleus probs) / T on the kept tokens, 0
    on the others: the mask is a constant."""
    x = logits().requires_grad_(True)
    token_logprobs(x, torch.tensor([3]), TEMPERATURE, 0.6).sum().backward()
    nucleus = {1: 0.5 / 0.8, 3: 0.3 / 0.8}
    want = [((i == 3) - nucleus[i]) / TEMPERATURE if i in nucleus else 0.0 for i in range(4)]
    torch.testing.assert_close(x.grad.double(), torch.tensor([want], dtype=torch.float64),
                               atol=ATOL, rtol=0)


def test_a_token_outside_the_nucleus_gets_the_floor_and_the_ratio_clips():
    """Token 0 (p 0.05) is outside the 0.6 nucleus: its logprob is LOGPROB_FLOOR, finite, with
    gradient 0; the update's ratio against a behaviour logprob of log 0.05 is then ~0 and
    clips (a negative advantage: the clipped term is the one taken), and its k3 KL to a
    reference that holds the token is finite: exp(0 - LOGPROB_FLOOR) = 1 / float32's tiny."""
    assert LOGPROB_FLOOR == pytest.approx(-87.3365, abs=1e-4)
    x = logits().requires_grad_(True)
    logp = token_logprobs(x, torch.tensor([0]), TEMPERATURE, 0.6)
    assert torch.equal(logp, torch.tensor([LOGPROB_FLOOR]))  # the floor in float32
    logp.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))

    x.grad = None
    logp = token_logprobs(x, torch.tensor([0]), TEMPERATURE, 0.6)[:, None]  # [1, 1]
    behaviour = torch.tensor([[math.log(0.05)]])
    ref = torch.tensor([[0.0]])  # a reference whose nucleus is that token alone
    parts = policy_loss(logp, behaviour, torch.tensor([[-1.0]]), torch.ones(1, 1, dtype=bool),
                        ref, LossParams(clip_eps=0.2, kl_coef=1.0), 1)
    assert parts.pg.ratio.item() < 1e-30 and parts.pg.clipped.item() == 1
    assert parts.pg.loss.item() == pytest.approx(0.8)  # -clip(ratio) * A = 1 - eps
    assert math.isfinite(parts.loss.item()) and parts.kl.item() > 1e37
    parts.loss.backward()
    assert torch.isfinite(x.grad).all()
