"""The embedded default task: "tally", a counting task with verifiable answers.

A prompt lists n items; the correct response enumerates them with a running count and
ends with the total::

    prompt:   Count the items one by one, then give the total.
              Items: fig pear plum
              Answer:
    response:  1 fig 2 pear 3 plum = 3

Every prompt starts with the same instruction, so prefix dedup has a shared template to
save. n is drawn log-uniformly from 1..``max_items``, so response lengths vary a lot
between prompts (coefficient of variation above 0.5), as in reasoning RL where a few long
answers make the long tail.

The supervised warm start imitates a *noisy demonstrator*: in ``demo_error_rate`` of its
demonstrations the total is off by one (it counts the "=" as an item). The warm-started
policy therefore knows how to enumerate but writes the wrong total more often than the
right one, so greedy decoding is mostly wrong while sampling is right some of the time:
exactly the gap a verifiable reward can close. That is the signal RL has to find.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

INSTRUCTION = "Count the items one by one, then give the total.\n"
WORDS = (
    "apple pear plum fig kiwi lime lemon mango melon peach grape olive date cherry berry "
    "onion leek kale bean pea corn rice oat rye wheat salt honey tea milk egg bread "
    "cake pie jam nut seed leaf root stem rose lily"
).split()
DATA_SOURCE = "tally"


@dataclass(frozen=True)
class TallyTask:
    """Sizes of the synthetic task; one frozen recipe, hashed into the model cache key."""

    max_items: int = 24  # longest list; log-uniform counts give a long tail of lengths
    demo_error_rate: float = 0.6  # share of warm-start demonstrations with a wrong total
    n_train: int = 2048  # RL prompts
    n_heldout: int = 256  # evaluation prompts, disjoint from the RL and SFT prompts
    n_sft: int = 12000  # warm-start demonstrations

    def draw_count(self, rng: random.Random) -> int:
        return _draw_count(rng, self.max_items)


@dataclass(frozen=True)
class LongTailTallyTask(TallyTask):
    """The long-tail setting: most lists short, a few several times longer, so a few
    responses decode several times longer than the median (the tail that migration and
    reconfiguration act on). Counts stay within the default ``max_items``, so the default
    embedded model, warm-started on them, answers these prompts as it is."""

    short_items: tuple[int, int] = (2, 5)  # uniform count range of the common short lists
    long_items: tuple[int, int] = (18, 24)  # uniform count range of the long ones
    long_share: float = 0.1  # share of long lists

    def draw_count(self, rng: random.Random) -> int:
        low, high = self.long_items if rng.random() < self.long_share else self.short_items
        return rng.randint(low, high)


def _draw_count(rng: random.Random, max_items: int) -> int:
    # log-uniform on [1, max_items]: many short lists, a tail of long ones
    return min(max_items, int(max_items ** rng.random()))


def make_prompt(items: list[str]) -> str:
    return f"{INSTRUCTION}Items: {' '.join(items)}\nAnswer:"


def make_response(items: list[str], total: int) -> str:
    steps = " ".join(f"{i} {item}" for i, item in enumerate(items, start=1))
    return f" {steps} = {total}"


def sample_items(rng: random.Random, task: TallyTask) -> list[str]:
    return [rng.choice(WORDS) for _ in range(task.draw_count(rng))]


def make_splits(task: TallyTask, seed: int) -> dict[str, list[dict]]:
    """Disjoint prompt sets for RL ("train"), evaluation ("heldout") and the warm start
    ("sft", whose rows carry a demonstration ``response``). Deterministic for ``seed``."""
    rng = random.Random(seed)
    seen: set[str] = set()
    splits: dict[str, list[dict]] = {"heldout": [], "train": [], "sft": []}
    sizes = {"heldout": task.n_heldout, "train": task.n_train, "sft": task.n_sft}
    for name in ("heldout", "train", "sft"):
        while len(splits[name]) < sizes[name]:
            items = sample_items(rng, task)
            prompt = make_prompt(items)
            if name != "sft":  # SFT may repeat itself, but never an RL or held-out prompt
                if prompt in seen:
                    continue
                seen.add(prompt)
            elif prompt in seen:
                continue
            row = {
                "prompt_id": f"{name}-{len(splits[name])}",
                "prompt": prompt,
                "answer": str(len(items)),
                "data_source": DATA_SOURCE,
            }
            if name == "sft":
                wrong = rng.random() < task.demo_error_rate
                row["response"] = make_response(items, len(items) + int(wrong))
            splits[name].append(row)
    return splits


def corpus_lines(task: TallyTask, seed: int) -> list[str]:
    """Text the tokenizer is trained on: every word, count and template the task uses."""
    rng = random.Random(seed + 1)
    lines = [make_prompt(sample_items(rng, task)) for _ in range(2000)]
    lines += [make_response(WORDS[: n % len(WORDS) + 1], n) for n in range(task.max_items + 2)]
    lines += [" ".join(str(n) for n in range(task.max_items + 2))]
    return lines
