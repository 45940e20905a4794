"""Agents for the agent-episode tests, named ``"openai_agents:<function>"`` (the agent process
imports them by name: it inherits the test's ``sys.path``). Each is written against the
``openai`` client as an agent author would; none builds a request by hand."""

from __future__ import annotations

import os
import time

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "List the items in a box.",
    "parameters": {"type": "object", "properties": {"box": {"type": "string"}},
                   "required": ["box"]}}}


def two_turns(client, row, model):
    """Two requests of one conversation: the first answer goes back (a tool result for each
    tool call it made, else a user message), then the last answer's length is the reward."""
    messages = [{"role": "user", "content": row["prompt_text"]}]
    first = client.chat.completions.create(model=model, messages=messages, tools=[LOOKUP],
                                           max_tokens=8)
    answer = first.choices[0].message
    messages.append(answer.model_dump(exclude_none=True))
    if answer.tool_calls:
        messages += [{"role": "tool", "tool_call_id": c.id, "content": "fig pear"}
                     for c in answer.tool_calls]
    else:
        messages.append({"role": "user", "content": "Items: fig pear\nAnswer:"})
    second = client.chat.completions.create(model=model, messages=messages, tools=[LOOKUP],
                                            max_tokens=8)
    return float(len(second.choices[0].message.content or ""))


def two_turns_as_responses(client, row, model):
    """``two_turns`` spoken as OpenAI's Responses API: the first response's output items, and
    a function call output for each function call (else a user message), go back."""
    tools = [{"type": "function", **LOOKUP["function"]}]
    items = [{"role": "user", "content": row["prompt_text"]}]
    first = client.responses.create(model=model, input=items, tools=tools, max_output_tokens=8)
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items += [{"type": "function_call_output", "call_id": o.call_id, "output": "fig pear"}
              for o in first.output if o.type == "function_call"] \
        or [{"role": "user", "content": "Items: fig pear\nAnswer:"}]
    second = client.responses.create(model=model, input=items, tools=tools, max_output_tokens=8)
    return float(len(second.output_text))


def two_turns_as_messages(client, row, model):
    """``two_turns`` spoken as Anthropic's Messages API, with an ``anthropic`` client on the
    episode's endpoint and key: the first answer's content blocks, and a tool result for each
    tool use (else the user's text), go back."""
    import anthropic  # here: the other agents' processes start without it

    speaker = anthropic.Anthropic(base_url=str(client.base_url).removesuffix("/v1/"),
                                  api_key=client.api_key, max_retries=0)
    function = LOOKUP["function"]
    tools = [{"name": function["name"], "description": function["description"],
              "input_schema": function["parameters"]}]
    messages = [{"role": "user", "content": row["prompt_text"]}]
    first = speaker.messages.create(model=model, messages=messages, tools=tools, max_tokens=8)
    messages.append({"role": "assistant",
                     "content": [b.model_dump(exclude_none=True) for b in first.content]})
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": b.id, "content": "fig pear"}
        for b in first.content if b.type == "tool_use"] or "Items: fig pear\nAnswer:"})
    second = speaker.messages.create(model=model, messages=messages, tools=tools, max_tokens=8)
    return float(len("".join(b.text for b in second.content if b.type == "text")))


def branches(client, row, model):
    """A request of two samples, then one of completions that extends neither."""
    client.chat.completions.create(model=model, n=2, max_tokens=6,
                                   messages=[{"role": "user", "content": row["prompt_text"]}])
    client.completions.create(model=model, prompt="Items: kiwi\nAnswer:", max_tokens=6)
    return 1.0


def raises(client, row, model):
    client.completions.create(model=model, prompt=row["prompt_text"], max_tokens=4)
    raise RuntimeError("the agent broke")


def hangs(client, row, model):
    time.sleep(30)
    return 1.0


def never_calls(client, row, model):
    return 1.0


def not_a_number(client, row, model):
    client.completions.create(model=model, prompt=row["prompt_text"], max_tokens=4)
    return "yes"


def thinks_then_asks(client, row, model):
    """Half a second of the agent's own work before its one request (a tool, a planner)."""
    time.sleep(0.5)
    client.completions.create(model=model, prompt=row["prompt_text"], max_tokens=4)
    return 1.0


def asks_once_or_twice(client, row, model):
    """One completion request; a second one in odd samples."""
    for _ in range(1 + row["sample_idx"] % 2):
        client.completions.create(model=model, prompt=row["prompt_text"], max_tokens=4)
    return 1.0


def reports_its_process(client, row, model):
    """One request; the reward is the id of the process the episode ran in."""
    client.completions.create(model=model, prompt=row["prompt_text"], max_tokens=2)
    return float(os.getpid())
