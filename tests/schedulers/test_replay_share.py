"""The replay share policy: replace follows g/u up to max_share, fill uses only the trainer's
idle time, fixed ignores the balance; bad knobs are named."""

from __future__ import annotations

import pytest

from rlhfless.schedulers.replay_share import ReplayShare


def test_replace_share_grows_with_the_generation_share():
    share = ReplayShare(batch=32, max_share=0.5, mix="replace", alpha=1.0)
    assert share.decide().replayed == 16  # no measurement yet: the most
    share.observe(gen_seconds=1.0, prompts_generated=16, update_seconds=4.0, groups_trained=32)
    d = share.decide()  # a whole batch: g = 2 s, u = 4 s -> half of max_share
    assert (d.gen_s, d.update_s) == (2.0, 4.0)
    assert (d.replayed, d.fresh) == (8, 24)
    share.observe(gen_seconds=6.0, prompts_generated=24, update_seconds=4.0, groups_trained=32)
    assert share.decide().replayed == 16  # generation the bottleneck: all of max_share


def test_fill_takes_replayed_groups_only_into_the_trainers_idle_time():
    share = ReplayShare(batch=32, max_share=0.5, mix="fill", alpha=1.0)
    share.observe(gen_seconds=3.0, prompts_generated=32, update_seconds=2.0, groups_trained=32)
    d = share.decide()  # idle 1 s at 1/16 s per group: 16, capped by max_share (16)
    assert (d.replayed, d.fresh) == (16, 32)
    share.observe(gen_seconds=2.5, prompts_generated=32, update_seconds=3.0, groups_trained=48)
    assert share.decide().replayed == 8  # g - u = 0.5 s at u/B = 1/16 s
    share.observe(gen_seconds=1.0, prompts_generated=32, update_seconds=4.0, groups_trained=32)
    assert share.decide().replayed == 0  # update-bound: async


def test_ewma_and_fixed_sharing():
    share = ReplayShare(batch=10, max_share=0.3, mix="replace", sharing="fixed", alpha=0.5)
    share.observe(1.0, 10, 1.0, 10)
    share.observe(3.0, 10, 1.0, 10)
    assert share.gen_s == pytest.approx(2.0)
    assert share.decide().replayed == 3
    assert ReplayShare(batch=2, max_share=0.9, mix="replace").most == 1  # one stays fresh


@pytest.mark.parametrize("kw", [{"mix": "both"}, {"sharing": "auto"}, {"max_share": 1.0},
                                {"batch": 0}, {"alpha": 0.0}])
def test_bad_knobs_are_named(kw):
    with pytest.raises(ValueError, match="ReplayShare"):
        ReplayShare(**({"batch": 4, "max_share": 0.5} | kw))


def test_gradient_share_bounds_the_replayed_groups():
    share = ReplayShare(batch=32, max_share=0.5, mix="replace", sharing="fixed",
                        max_grad_share=0.5, alpha=1.0)
    assert share.decide().replayed == 16  # nothing measured: no bound yet
    share.observe(1.0, 16, 1.0, 32, informative_frac=0.5)
    d = share.decide()  # replayed <= 0.5 * (32 - replayed): 10 of 32
    assert (d.replayed, d.fresh) == (10, 22) and "gradient share" in d.reason
    assert d.replayed <= 0.5 * d.fresh
    fill = ReplayShare(batch=32, max_share=0.5, mix="fill", sharing="fixed",
                       max_grad_share=0.25, alpha=1.0)
    fill.observe(1.0, 32, 1.0, 32, informative_frac=0.9)
    assert fill.decide().replayed == 9  # 1/3 * 0.9 * 32 = 9.6
