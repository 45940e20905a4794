"""Tests of the embedded tally task: deterministic, disjoint splits with a long tail of
response lengths, and a demonstrator that is wrong as often as the recipe says."""

from __future__ import annotations

import statistics

import pytest

from rlhfless.ops.toy.tinytask import (
    DATA_SOURCE,
    INSTRUCTION,
    TallyTask,
    make_prompt,
    make_response,
    make_splits,
)


@pytest.fixture(scope="module")
def task() -> TallyTask:
    return TallyTask()


@pytest.fixture(scope="module")
def splits(task):
    return make_splits(task, seed=0)


def items_of(prompt: str) -> list[str]:
    return prompt.split("Items: ", 1)[1].split("\n", 1)[0].split()


def test_splits_are_deterministic_for_a_seed(task, splits):
    assert make_splits(task, seed=0) == splits
    other = make_splits(task, seed=1)
    assert [r["prompt"] for r in other["train"]] != [r["prompt"] for r in splits["train"]]


def test_split_sizes_and_rows(task, splits):
    assert {k: len(v) for k, v in splits.items()} == {
        "heldout": task.n_heldout, "train": task.n_train, "sft": task.n_sft
    }
    for name, rows in splits.items():
        assert [r["prompt_id"] for r in rows] == [f"{name}-{i}" for i in range(len(rows))]
        for row in rows:
            items = items_of(row["prompt"])
            assert row["prompt"] == make_prompt(items)
            assert row["prompt"].startswith(INSTRUCTION)  # the shared template
            assert row["answer"] == str(len(items))
            assert 1 <= len(items) <= task.max_items
            assert row["data_source"] == DATA_SOURCE


def test_rl_heldout_and_sft_prompts_are_disjoint(splits):
    prompts = {name: [r["prompt"] for r in rows] for name, rows in splits.items()}
    for name in ("heldout", "train"):
        assert len(set(prompts[name])) == len(prompts[name])  # no repeats either
    assert not set(prompts["heldout"]) & set(prompts["train"])
    assert not set(prompts["sft"]) & (set(prompts["heldout"]) | set(prompts["train"]))


def test_response_lengths_have_a_long_tail(splits, tokenizer):
    responses = [make_response(items_of(r["prompt"]), int(r["answer"])) for r in splits["train"]]
    lengths = [len(ids) for ids in tokenizer(responses, add_special_tokens=False)["input_ids"]]
    cv = statistics.pstdev(lengths) / statistics.mean(lengths)
    assert cv >= 0.5


def test_demonstrations_err_at_the_recipe_rate(task, splits):
    wrong = 0
    for row in splits["sft"]:
        items = items_of(row["prompt"])
        total = int(row["response"].rsplit("= ", 1)[1])
        assert row["response"] == make_response(items, total)  # the enumeration is right
        assert total in (len(items), len(items) + 1)  # off by one when wrong
        wrong += total != len(items)
    rate = wrong / len(splits["sft"])
    # binomial standard error at n = 12000 is about 0.0045
    assert rate == pytest.approx(task.demo_error_rate, abs=0.03)


def test_make_response_format():
    assert make_response(["fig", "pear", "plum"], 3) == " 1 fig 2 pear 3 plum = 3"
    assert make_prompt(["fig"]) == f"{INSTRUCTION}Items: fig\nAnswer:"


def test_long_tail_setting_has_a_few_lists_several_times_the_median():
    from rlhfless.ops.toy.tinytask import LongTailTallyTask

    rows = make_splits(LongTailTallyTask(n_train=400, n_heldout=1, n_sft=0), seed=0)["train"]
    counts = [len(items_of(r["prompt"])) for r in rows]
    median = statistics.median(counts)
    long = [n for n in counts if n >= 4 * median]
    assert median <= 5 and 0.05 <= len(long) / len(counts) <= 0.2
    assert max(counts) <= TallyTask().max_items  # within what the default model learned
