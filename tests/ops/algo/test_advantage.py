"""Tests of the advantage stage: GRPO and RLOO against hand-computed numbers."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfless.ops.algo.advantage import advantage_summary, compute_advantages, turn_advantages
from rlhfless.ops.data.schema import ROLLOUTS, SCORED, TRAINABLE
from rlhfless.ops.rollouts.reward import score


def scored(prompt_ids: list[str], rewards: list[float]) -> pa.Table:
    """A small table with the columns the advantage stage reads, plus a row marker."""
    return pa.table(
        {
            "prompt_id": pa.array(prompt_ids, pa.string()),
            "reward": pa.array(rewards, pa.float64()),
            "row": pa.array(range(len(rewards)), pa.int64()),
        }
    )


# Two prompts x four samples, interleaved so that row order matters:
#   a: rewards 1, 0, 0, 1   mean 0.5   deviations +-0.5   ddof=1 std sqrt(1/3)
#   b: rewards 1, 0, 0, 0   mean 0.25  deviations .75, -.25 x3  ddof=1 std sqrt(0.75/3) = 0.5
EXAMPLE = scored(["a", "b", "a", "b", "a", "b", "a", "b"], [1, 1, 0, 0, 0, 0, 1, 0])
# GRPO: a -> +-0.5 / 0.57735 = +-0.8660254 (sqrt(3)/2); b -> 0.75/0.5 = 1.5, -0.25/0.5 = -0.5
GRPO = [0.8660254, 1.5, -0.8660254, -0.5, -0.8660254, -0.5, 0.8660254, -0.5]
# Dr. GRPO (scale=False): the deviations themselves
CENTRED = [0.5, 0.75, -0.5, -0.25, -0.5, -0.25, 0.5, -0.25]
# RLOO: r_i minus the mean of the other three.
#   a: 1 - (0+0+1)/3 = 2/3,  0 - (1+0+1)/3 = -2/3
#   b: 1 - (0+0+0)/3 = 1,    0 - (1+0+0)/3 = -1/3
RLOO = [2 / 3, 1.0, -2 / 3, -1 / 3, -2 / 3, -1 / 3, 2 / 3, -1 / 3]


def advantages(table: pa.Table) -> list[float]:
    return table.column("advantage").to_pylist()


def test_grpo_matches_hand_computation() -> None:
    out = compute_advantages(EXAMPLE)
    assert out.schema.field("advantage").type == pa.float32()
    assert advantages(out) == pytest.approx(GRPO, abs=1e-5)


def test_grpo_unscaled_matches_hand_computation() -> None:
    assert advantages(compute_advantages(EXAMPLE, scale=False)) == pytest.approx(CENTRED)


def test_rloo_matches_hand_computation() -> None:
    assert advantages(compute_advantages(EXAMPLE, "rloo")) == pytest.approx(RLOO, abs=1e-6)


def test_turn_credit_matches_hand_computation() -> None:
    """Return to go per turn, GRPO within (prompt, turn index):
    a0: turns 2, steps [0, 1], reward 1.5 (0.5 final)  G = [1.5, 1.5]
    a1: turns 1, steps [0],    reward 0                G = [0]
    a2: turns 2, steps [.5, 0], reward .5              G = [.5, 0]
    slot (a, 0): [1.5, 0, .5], mean 2/3, ddof=1 std sqrt(21)/6 -> 1.0910895, -0.8728716,
                 -0.2182179 (the sequences' own GRPO advantages); slot (a, 1): [1.5, 0] ->
                 +-0.7071068; b0's slots hold one turn each -> 0; b1's two turns touch (no
                 observation between them): one run, its sequence advantage."""
    table = pa.table({
        "prompt_id": ["a", "a", "a", "b", "b"],
        "reward": pa.array([1.5, 0.0, 0.5, 1.0, 0.0], pa.float64()),
        "turn_rewards": pa.array([[0.0, 1.0], [0.0], [0.5, 0.0], [1.0, 0.0], [0.0, 0.0]],
                                 pa.list_(pa.float64())),
        "turns": pa.array([2, 1, 2, 2, 2], pa.int32()),
        "loss_mask": pa.array([[0, 1, 1, 0, 1], [0, 1, 1], [0, 1, 0, 1], [1, 0, 1], [1, 1]],
                              pa.list_(pa.int8())),
    })
    table = compute_advantages(table)
    out = turn_advantages(table).to_pylist()
    assert [len(t) for t in out] == [2, 1, 2, 2, 1]
    want = [[1.0910895, 0.7071068], [-0.8728716], [-0.2182179, -0.7071068], [0.0, 0.0],
            [-0.7071068]]
    for got, expected in zip(out, want):
        assert got == pytest.approx(expected, abs=1e-5)
    sequence = advantages(table)
    assert [t[0] for t in out[:3]] == pytest.approx(sequence[:3], abs=1e-6)
    unscaled = turn_advantages(table, scale=False).to_pylist()
    assert unscaled[0] == pytest.approx([5 / 6, 0.75]) and unscaled[3] == [0.0, 0.0]


def test_rows_and_columns_keep_their_order() -> None:
    out = compute_advantages(EXAMPLE, "rloo")
    assert out.column_names == ["prompt_id", "reward", "row", "advantage"]
    assert out.select(["prompt_id", "reward", "row"]).equals(EXAMPLE)


def test_chunked_input_gives_the_same_result() -> None:
    chunked = pa.concat_tables([EXAMPLE.slice(0, 3), EXAMPLE.slice(3, 5)])
    assert chunked.column("reward").num_chunks == 2
    assert advantages(compute_advantages(chunked)) == pytest.approx(GRPO, abs=1e-5)


def test_single_sample_group() -> None:
    table = scored(["a", "b", "a"], [1.0, 0.7, 0.0])
    out = compute_advantages(table)
    assert advantages(out)[1] == 0.0  # GRPO: no group to compare with
    assert advantages(compute_advantages(table, scale=False))[1] == 0.0
    with pytest.raises(ValueError, match=r"RLOO needs at least 2 samples.*'b'"):
        compute_advantages(table, "rloo")


def test_equal_rewards_give_exactly_zero() -> None:
    table = scored(["a", "a", "a", "b", "b"], [0.1, 0.1, 0.1, 1.0, 0.0])
    for method in ("grpo", "rloo"):
        out = compute_advantages(table, method)
        assert advantages(out)[:3] == [0.0, 0.0, 0.0]
        assert advantage_summary(out)["zero_adv_groups"] == 0.5


def test_advantage_summary() -> None:
    out = compute_advantages(EXAMPLE, "rloo")
    # |adv|: a gives 4 x 2/3, b gives 1 + 3 x 1/3 -> (8/3 + 2) / 8
    assert advantage_summary(out) == {
        "zero_adv_groups": 0.0,
        "adv_abs_mean": pytest.approx((8 / 3 + 2) / 8, abs=1e-6),
    }


def test_n_samples_checks_group_sizes() -> None:
    assert compute_advantages(EXAMPLE, n_samples=4).num_rows == 8
    with pytest.raises(ValueError, match=r"prompt_id 'a' has 4 samples, expected n_samples=5"):
        compute_advantages(EXAMPLE, n_samples=5)


def test_empty_table() -> None:
    out = compute_advantages(EXAMPLE.slice(0, 0))
    assert out.num_rows == 0 and "advantage" in out.column_names
    assert advantage_summary(out) == {"zero_adv_groups": 0.0, "adv_abs_mean": 0.0}


def test_pipeline_schema_from_rollouts_to_trainable() -> None:
    n = 4
    rollouts = pa.Table.from_pydict(
        {
            "prompt_id": ["p0", "p0", "p1", "p1"],
            "prompt_ids": [[1, 2]] * n,
            "answer": ["2", "2", "3", "3"],
            "data_source": ["tally"] * n,
            "sample_idx": [0, 1, 0, 1],
            "response_ids": [[3]] * n,
            "response_text": [" 1 a 2 b = 2", " 1 a 2 b = 3", " 1 a 2 b 3 c = 3", "= 3"],
            "logprobs": [[-1.0]] * n,
            "finish_reason": ["stop"] * n,
            "policy_version": [0] * n,
            "worker": ["w"] * n,
            "gen_start": [0.0] * n,
            "gen_end": [1.0] * n,
        },
        schema=ROLLOUTS,
    )
    out = compute_advantages(score(rollouts), "rloo")
    assert out.schema == TRAINABLE
    assert out.select(SCORED.names).schema == SCORED
    assert advantages(out) == [1.0, -1.0, 0.0, 0.0]


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("table", "kwargs", "message"),
    [
        (EXAMPLE.drop_columns(["reward"]), {}, "missing column 'reward'"),
        (EXAMPLE, {"method": "ppo"}, "unknown method 'ppo'"),
        (EXAMPLE, {"eps": 0.0}, "eps must be > 0"),
        (scored(["a", "a"], [1.0, float("nan")]), {}, "reward is nan at row 1"),
        (scored(["a", "a"], [0.0, 1e300]), {}, "reward is 1e\\+300 at row 1.*within 1e\\+15"),
        (
            pa.table({"prompt_id": ["a", None], "reward": [1.0, 0.0]}),
            {},
            "'prompt_id' is null at row 1",
        ),
        (compute_advantages(EXAMPLE), {}, "already has an 'advantage' column"),
    ],
)
def test_bad_input_is_named(table: pa.Table, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        compute_advantages(table, **kwargs)


# ---------------------------------------------------------------- against a plain loop


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("abcd"), st.sampled_from([0.0, 0.5, 1.0, -2.0])),
        min_size=1,
        max_size=24,
    )
)
def test_matches_per_group_loop(samples: list[tuple[str, float]]) -> None:
    ids = [prompt for prompt, _ in samples]
    rewards = np.array([reward for _, reward in samples])
    table = scored(ids, rewards.tolist())
    grpo = np.array(advantages(compute_advantages(table)))
    for i, prompt in enumerate(ids):
        group = rewards[[j for j, p in enumerate(ids) if p == prompt]]
        std = group.std(ddof=1) if len(group) > 1 else 0.0
        expected = 0.0 if np.ptp(group) == 0 else (rewards[i] - group.mean()) / (std + 1e-6)
        assert grpo[i] == pytest.approx(expected, rel=1e-5, abs=1e-5)
    if min(ids.count(p) for p in ids) < 2:
        return
    rloo = np.array(advantages(compute_advantages(table, "rloo")))
    for i, prompt in enumerate(ids):
        others = [rewards[j] for j, p in enumerate(ids) if p == prompt and j != i]
        assert rloo[i] == pytest.approx(rewards[i] - sum(others) / len(others), abs=1e-5)
