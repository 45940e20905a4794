"""The embedded multi-turn task (ops/toy/tinytool.py) and its warm-start demonstrations."""

from __future__ import annotations

from rlhfless.ops.rollouts.reward import exact_reward
from rlhfless.ops.toy.tinymodel import TASK_RECIPES, TinyRecipe, _demo_tokens, build_tokenizer
from rlhfless.ops.toy.tinytool import TallyToolTask, box_items, make_splits, observation, tool_call

TASK = TallyToolTask(n_train=64, n_heldout=16, n_sft=64)


def test_splits_are_disjoint_and_answers_are_the_box_counts():
    splits = make_splits(TASK, seed=0)
    boxes = {name: {r["prompt"] for r in rows} for name, rows in splits.items()}
    assert not boxes["train"] & boxes["heldout"] and not boxes["sft"] & boxes["heldout"]
    assert not boxes["sft"] & boxes["train"]
    for row in splits["train"]:
        box = int(row["prompt"].split("box ")[1].split(".")[0])
        assert row["answer"] == str(len(box_items(box, TASK.max_items)))
    def shown(obs: str) -> list[str]:  # the items of an observation
        return obs.removeprefix("<tool_response>").split("</tool_response>")[0].split()

    wrong = sum(exact_reward(r["segments"][2][0], str(len(shown(r["segments"][1][0])))) == 0
                for r in splits["sft"])
    assert 0.3 * TASK.n_sft < wrong < 0.9 * TASK.n_sft  # the noisy demonstrator


def test_demonstrations_train_on_the_turns_only():
    tok = build_tokenizer(TinyRecipe(task=TASK))
    row = make_splits(TASK, seed=0)["sft"][0]
    ids, labels = _demo_tokens(row, tok)
    prompt = tok(row["prompt"], add_special_tokens=False)["input_ids"]
    call = tok(row["segments"][0][0], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    obs = tok(row["segments"][1][0], add_special_tokens=False)["input_ids"]
    answer = tok(row["segments"][2][0], add_special_tokens=False)["input_ids"]
    assert ids == prompt + call + obs + answer + [tok.eos_token_id]
    assert labels == [-100] * len(prompt) + call + [-100] * len(obs) + answer \
        + [tok.eos_token_id]
    assert tool_call(7).startswith("<tool_call>") and observation(["fig"]).endswith("Answer:")
    assert TASK_RECIPES["tally-tool"].key() != TASK_RECIPES["tally"].key()
    assert TASK_RECIPES["tally"].key() == TinyRecipe().key()  # the default model is unchanged
