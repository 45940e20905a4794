"""Tests of the reward stage: built-in verifiers, routing, per-sample failure handling."""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import numpy as np
import pyarrow as pa
import pytest

from rlhfless.ops.algo.advantage import compute_advantages
from rlhfless.ops.data.schema import MAX_ABS_REWARD, ROLLOUTS, SCORED
from rlhfless.ops.rollouts.reward import (
    VERIFIERS,
    GuardedCaller,
    RewardTimeout,
    call_with_timeout,
    exact_reward,
    final_answer,
    math_reward,
    reward_error_counts,
    reward_summary,
    score,
)


def rows(*triples: tuple[str | None, str | None, str | None]) -> pa.Table:
    """A small table of (response_text, answer, data_source) rows with the ROLLOUTS types."""
    texts, answers, sources = zip(*triples, strict=True)
    return pa.table(
        {
            "response_text": pa.array(texts, pa.string()),
            "answer": pa.array(answers, pa.string()),
            "data_source": pa.array(sources, pa.string()),
        }
    )


def full_rollouts(texts: list[str], answer: str = "3") -> pa.Table:
    n = len(texts)
    return pa.Table.from_pydict(
        {
            "prompt_id": [f"p{i // 2}" for i in range(n)],
            "prompt_ids": [[1, 2, 3]] * n,
            "answer": [answer] * n,
            "data_source": ["tally"] * n,
            "sample_idx": [i % 2 for i in range(n)],
            "response_ids": [[4, 5]] * n,
            "response_text": texts,
            "logprobs": [[-0.5, -0.25]] * n,
            "finish_reason": ["stop"] * n,
            "policy_version": [0] * n,
            "worker": ["w0"] * n,
            "gen_start": [1.0] * n,
            "gen_end": [2.0] * n,
        },
        schema=ROLLOUTS,
    )


@pytest.fixture(scope="module", autouse=True)
def warm_math_verify() -> None:
    """The first math-verify call builds its regexes; keep that out of timed tests."""
    math_reward("= 1", "1")


@pytest.fixture
def release() -> threading.Event:
    """Set at teardown so hanging reward functions of a test end instead of leaking."""
    event = threading.Event()
    yield event
    event.set()


# ---------------------------------------------------------------- verifiers


@pytest.mark.parametrize(
    "text",
    [
        "so the total is 7",
        "\\boxed{7}",
        "= 7",
        "3 + 4 = 7",
        "The answer is 7.",
        " 1 fig 2 pear 3 plum 4 kiwi 5 lime 6 date 7 fig = 7",
        "We add them up, answer 7",
        "first 5, then \\boxed{7}",
        "$\\frac{14}{2}$",
    ],
)
def test_math_accepts_correct_final_answer(text: str) -> None:
    assert math_reward(text, "7") == 1.0


@pytest.mark.parametrize("text", ["= 8", "so the total is 8", "7 + 1 = 8", "no idea", ""])
def test_math_rejects_wrong_or_missing_answer(text: str) -> None:
    assert math_reward(text, "7") == 0.0


def test_math_needs_ground_truth() -> None:
    with pytest.raises(ValueError, match="ground-truth"):
        math_reward("= 7", None)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1 fig 2 pear = 2", "2"),
        ("x = 1, so y = 5.", "5"),
        ("#### 42", "42"),
        ("The Answer is   forty  two.", "forty two"),
        ("answer: $12$", "12"),
        ("we get \\boxed{\\frac{1}{2}} = 0.5", "\\frac{1}{2}"),
        ("no marker here", None),
    ],
)
def test_final_answer_rule(text: str, expected: str | None) -> None:
    assert final_answer(text) == expected


def test_exact_verifier() -> None:
    assert exact_reward("  forty\ttwo ", "forty two") == 1.0
    assert exact_reward("1 fig 2 pear = 2", "2") == 1.0
    assert exact_reward("1 fig 2 pear = 3", "2") == 0.0
    assert exact_reward("1 fig 2 pear", "2") == 0.0  # no marker, so no final answer
    assert exact_reward("= 2.0", "2") == 0.0  # exact, not numeric


# ---------------------------------------------------------------- score


def test_score_appends_scored_columns_and_keeps_the_rest() -> None:
    rollouts = full_rollouts([" 1 fig 2 pear 3 plum = 3", " 1 fig 2 pear 3 plum = 4"])
    scored = score(rollouts)
    assert scored.schema == SCORED
    assert scored.column("reward").to_pylist() == [1.0, 0.0]
    assert scored.column("reward_error").to_pylist() == [None, None]
    assert scored.select(ROLLOUTS.names).equals(rollouts)


def test_score_routes_by_data_source() -> None:
    table = rows(
        ("= 7", "7", "gsm8k"),  # not in reward_fns: default verifier
        ("abcd", None, "length"),
        ("= 7", "7", None),
        ("= 7", "7", "strict"),
    )
    fns = {"length": lambda text, answer: len(text) / 10, "strict": exact_reward}
    scored = score(table, fns)
    assert scored.column("reward").to_pylist() == [1.0, 0.4, 1.0, 1.0]
    exact_default = score(
        rows(("x = 7", "7", "gsm8k"), ("7 apples", "7", "gsm8k")), default="exact"
    )
    assert exact_default.column("reward").to_pylist() == [1.0, 0.0]


def test_failures_are_recorded_per_sample(release: threading.Event) -> None:
    def boom(text: str, answer: str | None) -> float:
        raise RuntimeError("bad " + "x" * 500)

    hang_returned = threading.Event()

    def hang(text: str, answer: str | None) -> float:
        release.wait(30)
        hang_returned.set()
        return 1.0

    fns = {
        "raise": boom,
        "nan": lambda t, a: float("nan"),
        "inf": lambda t, a: -math.inf,
        "str": lambda t, a: "1.0",
        "none": lambda t, a: None,
        "hang": hang,
        "numpy": lambda t, a: np.float32(0.5),
        "bool": lambda t, a: True,
    }
    sources = ["raise", "nan", "math", "inf", "str", "none", "hang", "numpy", "bool", None]
    table = rows(*[("= 7", "7", source) for source in sources])
    scored = score(table, fns, timeout_s=0.3, fallback=-1.0)
    assert not hang_returned.is_set()  # the table was scored without waiting for the hang
    rewards = scored.column("reward").to_pylist()
    errors = scored.column("reward_error").to_pylist()
    assert rewards == [-1.0, -1.0, 1.0, -1.0, -1.0, -1.0, -1.0, 0.5, 1.0, 1.0]
    assert errors[0].startswith("RuntimeError: bad xxx") and len(errors[0]) <= 200
    assert errors[1] == "non-finite reward nan"
    assert errors[3] == "non-finite reward -inf"
    assert errors[4].startswith("non-numeric reward '1.0'")
    assert errors[5].startswith("non-numeric reward None")
    assert errors[6] == "timeout after 0.3s"
    assert [errors[i] for i in (2, 7, 8, 9)] == [None] * 4
    assert reward_summary(scored) == {"reward_mean": pytest.approx(-2.5 / 10), "reward_errors": 6}
    assert reward_error_counts(scored) == {"reward_timeouts": 1, "reward_nonfinite": 2,
                                           "reward_out_of_range": 0, "reward_nonnumeric": 2,
                                           "reward_raised": 1}


def test_huge_and_overflowing_rewards_are_counted_bad_rewards() -> None:
    """``10**400`` crashed the stage (float() overflows); ``1e300`` was accepted, and its
    group's std overflowed to inf, zeroing every advantage of the group."""
    huge = {"1e300": 1e300, "-1e300": -1e300, "10**400": 10**400, "10**5000": 10**5000,
            "fraction": Fraction(10**400), "np": np.float64(-1e300), "limit": MAX_ABS_REWARD,
            "just_over": int(MAX_ABS_REWARD) + 1}
    fns = {name: (lambda v: lambda t, a: v)(value) for name, value in huge.items()}
    scored = score(rows(*[("= 7", "7", name) for name in huge]), fns, fallback=0.0)
    errors = dict(zip(huge, scored.column("reward_error").to_pylist()))
    assert errors.pop("limit") is None  # the limit itself is a reward
    for name, error in errors.items():
        assert error.startswith("reward out of range") and len(error) <= 200, (name, error)
    assert "1e+300" in errors["1e300"] and "1329 bits" in errors["10**400"]
    assert reward_error_counts(scored)["reward_out_of_range"] == len(huge) - 1
    assert scored.column("reward").to_pylist() == [0.0] * 6 + [MAX_ABS_REWARD, 0.0]


def test_a_huge_reward_leaves_the_advantages_of_its_batch() -> None:
    """Two groups, one sample of group a scored 1e300 by a user function: a counted bad
    reward with the fallback, and every group keeps non-zero advantages."""
    table = rows(("= 7", "7", "user"), ("= 7", "7", None), ("= 1", "7", None),
                 ("= 7", "7", None), ("= 1", "7", None), ("= 1", "7", None))
    table = table.append_column("prompt_id", pa.array(["a", "a", "a", "b", "b", "b"]))
    scored = score(table, {"user": lambda t, a: 1e300}, fallback=0.0)
    assert reward_summary(scored)["reward_errors"] == 1
    advantage = compute_advantages(scored).column("advantage").to_pylist()
    assert all(math.isfinite(x) for x in advantage)
    assert advantage[0] < 0 < advantage[1] and advantage[3] > 0 > advantage[4]


def test_null_answer_and_null_response_are_sample_errors() -> None:
    table = rows(("= 7", None, None), (None, "7", None), ("= 7", "7", None))
    scored = score(table)
    assert scored.column("reward").to_pylist() == [0.0, 0.0, 1.0]
    errors = scored.column("reward_error").to_pylist()
    assert errors[0].startswith("ValueError: math verifier needs a ground-truth answer")
    assert errors[1] == "null response_text"
    assert errors[2] is None


def test_busy_looping_function_is_interrupted() -> None:
    seen: list[threading.Thread] = []

    def spin(text: str, answer: str | None) -> float:
        seen.append(threading.current_thread())
        while True:
            pass

    scored = score(rows(("x", None, "spin")), {"spin": spin}, timeout_s=0.2)
    assert scored.column("reward_error").to_pylist() == ["timeout after 0.2s"]
    seen[0].join(2.0)
    assert not seen[0].is_alive()


def test_score_from_non_main_threads(release: threading.Event) -> None:
    def hang(text: str, answer: str | None) -> float:
        release.wait(30)
        return 1.0

    table = rows(("so the total is 7", "7", None), ("= 8", "7", None), ("x", None, "hang"))

    def run() -> pa.Table:
        assert threading.current_thread() is not threading.main_thread()
        return score(table, {"hang": hang}, timeout_s=0.2)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = [f.result(timeout=10) for f in [pool.submit(run) for _ in range(2)]]
    for scored in results:
        assert scored.column("reward").to_pylist() == [1.0, 0.0, 0.0]
        assert scored.column("reward_error").to_pylist() == [None, None, "timeout after 0.2s"]


def test_guarded_caller_reuses_its_worker_until_a_timeout(release: threading.Event) -> None:
    def whoami() -> threading.Thread:
        return threading.current_thread()

    with GuardedCaller() as caller:
        first = caller.call(whoami, (), 1.0)
        assert caller.call(whoami, (), 1.0) is first
        with pytest.raises(RewardTimeout, match="timeout after 0.1s"):
            caller.call(release.wait, (30,), 0.1)
        second = caller.call(whoami, (), 1.0)
    assert second is not first and second is not threading.current_thread()
    for thread in (first, second):  # abandoned or closed, each worker ends on its own
        if thread is first:
            release.set()
        thread.join(2.0)
        assert not thread.is_alive()


def test_call_with_timeout_returns_and_reraises() -> None:
    assert call_with_timeout(lambda x: x + 1, (1,), 1.0) == 2
    with pytest.raises(KeyError):
        call_with_timeout({}.__getitem__, ("missing",), 1.0)


def test_empty_table() -> None:
    scored = score(rows(("", "", "")).slice(0, 0))
    assert scored.num_rows == 0
    assert scored.column_names[-2:] == ["reward", "reward_error"]
    assert reward_summary(scored) == {"reward_mean": 0.0, "reward_errors": 0}


# ---------------------------------------------------------------- bad input


def test_missing_column_is_named() -> None:
    table = rows(("= 7", "7", None)).drop_columns(["answer"])
    with pytest.raises(ValueError, match="score: missing column 'answer'"):
        score(table)


def test_wrong_column_type_is_named() -> None:
    table = rows(("= 7", "7", None))
    table = table.set_column(1, "answer", pa.array([7], pa.int64()))
    with pytest.raises(ValueError, match="column 'answer' has type int64"):
        score(table)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"default": "fuzzy"}, "unknown default verifier 'fuzzy'"),
        ({"reward_fns": {"a": 1.0}}, r"reward_fns\['a'\] is float"),
        ({"timeout_s": 0}, "timeout_s must be a positive"),
        ({"fallback": float("nan")}, "fallback must be a finite"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        score(rows(("= 7", "7", None)), **kwargs)


def test_scoring_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="already has a 'reward' column"):
        score(score(rows(("= 7", "7", None))))


def test_registry_names() -> None:
    assert set(VERIFIERS) == {"math", "exact"}
