"""The embedded multi-turn task: "tally-tool", counting items that only a tool can show.

A prompt names a box; its items are behind the ``lookup`` tool, so the model has to call it,
read the observation and then count (two turns, the second after a tool response)::

    prompt:      Count the items in box 417.
                 Answer:
    turn 1:      <tool_call>{"name": "lookup", "arguments": {"box": "417"}}</tool_call><eos>
    observation: <tool_response>fig pear plum</tool_response>
                 Answer:
    turn 2:       1 fig 2 pear 3 plum = 3<eos>

A box's items are a fixed function of its number (``box_items``), so ``TallyToolEnv`` needs
no data beside the prompt row. The episode's reward is 1 when the final turn's total equals
the row's ``answer`` (the ``exact`` verifier), else 0.

As in ``ops/toy/tinytask.py``, the warm start imitates a noisy demonstrator: every demonstration
calls the tool correctly, but in ``demo_error_rate`` of them the total is off by one, so the
warm-started model uses the tool and enumerates, and RL has the total to fix. Demonstrations
are ``segments`` (text, trained?): the prompt and the observation are not trained on.

The same task as an agent (``agent = "tally-agent"``): ``tally_agent`` plays it with the
``openai`` client against the worker's endpoint, the lookup tool as an OpenAI tool call; the
tokenizer's ``CHAT_TEMPLATE`` renders a chat of it in exactly the format above, so the
warm-started model sees what it was trained on.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from ..rollouts.env import ToolEnvironment
from ..rollouts.reward import VERIFIERS
from ..rollouts.tools import Tool
from .tinytask import WORDS, make_response

DATA_SOURCE = "tally-tool"
NEXT_TURN = "Answer:"


@dataclass(frozen=True)
class TallyToolTask:
    """Sizes of the synthetic task; hashed into the model cache key (``kind`` keeps it
    apart from the single-turn task's)."""

    kind: str = "tally-tool"
    max_items: int = 12
    n_boxes: int = 10000
    demo_error_rate: float = 0.6
    n_train: int = 2048
    n_heldout: int = 256
    n_sft: int = 8000
    files: int = 2  # the tokenizer's files' version (2: its chat template is the task's)


# a chat of the task in its own format: the prompt, tool calls then EOS, the tool responses
# then the cue, an answer then EOS (``observation``; nothing added for the generation)
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}"
    "{%- for c in m.get('tool_calls') or [] -%}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "</tool_call>{%- endfor -%}"
    "{{ m['content'] or '' }}{{ eos_token }}"
    "{%- elif m['role'] == 'tool' -%}<tool_response>{{ m['content'] }}</tool_response>\n"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' -%}" + NEXT_TURN + "{%- endif -%}"
    "{%- else -%}{{ m['content'] }}{%- endif -%}"
    "{%- endfor -%}"
)
LOOKUP_TOOL = {"type": "function", "function": {
    "name": "lookup", "description": "List the items in a box.",
    "parameters": {"type": "object", "properties": {"box": {"type": "string"}},
                   "required": ["box"]}}}


def box_items(box: int, max_items: int = TallyToolTask.max_items) -> list[str]:
    """The items in box ``box``: a fixed function of the number (log-uniform count)."""
    rng = random.Random(box * 7919 + 17)
    n = min(max_items, int(max_items ** rng.random()))
    return [rng.choice(WORDS) for _ in range(n)]


def make_prompt(box: int) -> str:
    return f"Count the items in box {box}.\n{NEXT_TURN}"


def tool_call(box: int) -> str:
    return "<tool_call>" + json.dumps({"name": "lookup", "arguments": {"box": str(box)}}) \
        + "</tool_call>"


def observation(items: list[str]) -> str:
    return ToolEnvironment.response_format.format(" ".join(items)) + NEXT_TURN


def make_splits(task: TallyToolTask, seed: int) -> dict[str, list[dict]]:
    """Disjoint boxes for RL ("train"), evaluation ("heldout") and the warm start ("sft",
    whose rows carry demonstration ``segments``). Deterministic for ``seed``."""
    rng = random.Random(seed)
    need = task.n_heldout + task.n_train
    boxes = rng.sample(range(task.n_boxes), need)
    sft_pool = [b for b in range(task.n_boxes) if b not in set(boxes)]
    splits: dict[str, list[dict]] = {"heldout": [], "train": [], "sft": []}
    for name, chosen in (("heldout", boxes[: task.n_heldout]), ("train", boxes[task.n_heldout:])):
        for box in chosen:
            splits[name].append({"prompt_id": f"{name}-{len(splits[name])}",
                                 "prompt": make_prompt(box),
                                 "answer": str(len(box_items(box, task.max_items))),
                                 "data_source": DATA_SOURCE})
    for i in range(task.n_sft):
        box = rng.choice(sft_pool)
        items = box_items(box, task.max_items)
        wrong = rng.random() < task.demo_error_rate
        splits["sft"].append({
            "prompt_id": f"sft-{i}", "prompt": make_prompt(box),
            "segments": [[tool_call(box), True], [observation(items), False],
                         [make_response(items, len(items) + int(wrong)), True]],
        })
    return splits


def corpus_lines(task: TallyToolTask, seed: int) -> list[str]:
    """Text the tokenizer is trained on: prompts, tool calls, observations, answers."""
    rng = random.Random(seed + 1)
    lines = []
    for _ in range(2000):
        box = rng.randrange(task.n_boxes)
        items = box_items(box, task.max_items)
        lines += [make_prompt(box), tool_call(box), observation(items),
                  make_response(items, len(items))]
    lines += [" ".join(str(n) for n in range(task.max_items + 2))]
    return lines


class TallyToolEnv(ToolEnvironment):
    """The environment of the task: a ``lookup`` tool that lists a box's items."""

    next_turn = NEXT_TURN
    verifier = "exact"

    def __init__(self, max_items: int = TallyToolTask.max_items) -> None:
        super().__init__()
        self.max_items = max_items

    def tools(self) -> list[Tool]:
        return [Tool("lookup", "List the items in a box.",
                     {"type": "object", "properties": {"box": {"type": "string"}},
                      "required": ["box"]},
                     lambda box: " ".join(box_items(int(box), self.max_items)))]


def tally_agent(client, row: dict, model: str) -> float:
    """The task as an agent: ask, run each ``lookup`` call the answer makes and send its
    result back, until an answer without tool calls; 1 if its total is the row's answer."""
    messages = [{"role": "user", "content": row["prompt_text"]}]
    for _ in range(3):
        reply = client.chat.completions.create(model=model, messages=messages,
                                               tools=[LOOKUP_TOOL])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return VERIFIERS["exact"](message.content or "", row["answer"])
        for call in message.tool_calls:
            try:
                items = " ".join(box_items(int(json.loads(call.function.arguments)["box"])))
            except (ValueError, KeyError, TypeError) as err:
                items = f"error: {err}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": items})
    return 0.0
