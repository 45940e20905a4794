"""The per-worker continuous batching engine against a step-by-step reference."""

from __future__ import annotations

import numpy as np
import pytest

from rlhfless.schedulers.profiles import Profile
from rlhfless.schedulers.sim.engine import admission_steps, resume_run, simulate_run

PROFILE = Profile(name="test", tp=1, step_base_s=0.01, step_per_seq_s=1e-3,
                  step_per_ctx_token_s=1e-5, prefill_tokens_per_s=1000.0, max_batch=4,
                  kv_capacity_tokens=10**9, update_tokens_per_s_per_gpu=1.0)


def reference(lengths, ctx0, prefill, cap, prof=PROFILE):
    """One Python iteration per decode step: admit FIFO into free slots, step, retire."""
    queue = list(range(len(lengths)))
    live: dict[int, list[int]] = {}  # seq -> [generated, ctx]
    t, finish = 0.0, {}
    while queue or live:
        admitted = 0.0
        while queue and (cap is None or len(live) < cap):
            i = queue.pop(0)
            live[i] = [0, ctx0[i]]
            admitted += prefill[i]
        ctx = sum(c for _, c in live.values())
        t += prof.step_base_s + prof.step_per_seq_s * len(live) \
            + prof.step_per_ctx_token_s * ctx + admitted / prof.prefill_tokens_per_s
        for i in list(live):
            live[i][0] += 1
            live[i][1] += 1
            if live[i][0] == lengths[i]:
                finish[i] = t
                del live[i]
    return np.array([finish[i] for i in range(len(lengths))])


@pytest.mark.parametrize("cap", [None, 3])
def test_closed_form_matches_step_by_step(cap):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 30, size=11)
    ctx0 = rng.integers(5, 50, size=11).astype(float)
    prefill = rng.integers(0, 50, size=11).astype(float)
    run = simulate_run(2.0, np.arange(11), lengths, ctx0, prefill, PROFILE, cap)
    np.testing.assert_allclose(run.finish_times() - 2.0, reference(lengths, ctx0, prefill, cap))
    assert run.t_finish == pytest.approx(2.0 + reference(lengths, ctx0, prefill, cap).max())


def test_admission_is_fifo_list_scheduling():
    start = admission_steps(np.array([5, 2, 4, 1, 3]), cap=2)
    assert start.tolist() == [0, 0, 2, 5, 6]


def test_cut_and_resume_keep_every_token():
    lengths = np.array([10, 20, 30, 40])
    run = simulate_run(0.0, np.arange(4), lengths, np.full(4, 8.0), np.full(4, 8.0), PROFILE, 2)
    t = run.finish_times()[0] + 1e-9  # first sequence just done
    done, generated, admitted = run.state_at(t)
    assert done.tolist() == [True, False, False, False]
    assert admitted.tolist() == [True, True, False, False]  # seq 2 takes the slot next step
    cut = run.cut(t)
    assert (cut.end - cut.start).tolist() == generated.tolist()
    new = resume_run(t, run, np.array([7]), np.array([5]), np.array([40.0]), PROFILE, 2)
    left = lengths - generated
    assert sorted(new.seq.tolist()) == [1, 2, 3, 7]
    by_seq = dict(zip(new.seq.tolist(), (new.end - new.start).tolist(), strict=True))
    assert [by_seq[i] for i in (1, 2, 3)] == left[1:].tolist() and by_seq[7] == 5
    assert new.prefill[new.seq == 7][0] == 40.0  # migrated: its whole context recomputed
    assert new.t0 == t and new.done.all()


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="remaining tokens must be >= 1"):
        simulate_run(0.0, [0], [0], [1.0], [1.0], PROFILE, None)
    with pytest.raises(ValueError, match="one entry per sequence"):
        simulate_run(0.0, [0, 1], [1], [1.0], [1.0], PROFILE, None)
