"""Tools in the OpenAI function-call style.

A ``Tool`` is a Python callable with an OpenAI function schema (``Tool.schema()``::

    {"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}

the list chat templates take as ``tools=``). The model calls tools the way Hermes / Qwen chat
templates teach it, one JSON object per call::

    <tool_call>{"name": "lookup", "arguments": {"box": "417"}}</tool_call>

``parse_tool_calls`` finds the calls of a turn; ``call_tool`` runs one and turns every failure
of the model's call (unknown tool, bad arguments, the tool raising) into an error *result*
for the model to read, not an error of the episode.

The built-in code tool, ``run_python``, and its sandbox are in ``ops/rollouts/sandbox.py``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
RESULT_CHARS = 2000  # a tool result is cut to this many characters


@dataclass(frozen=True)
class Tool:
    """A function the model may call; ``parameters`` is a JSON schema of its arguments."""

    name: str
    description: str
    parameters: dict
    fn: Callable[..., object]

    def schema(self) -> dict:
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


def parse_tool_calls(text: str) -> list[ToolCall | str]:
    """The calls in a model turn, in order; a call that is not ``{"name": str, "arguments":
    {...}}`` JSON comes back as an error string in its place."""
    calls: list[ToolCall | str] = []
    for body in TOOL_CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(f"error: tool call is not JSON ({err.msg})")
            continue
        if (not isinstance(obj, dict) or not isinstance(obj.get("name"), str)
                or not isinstance(obj.get("arguments", {}), dict)):
            calls.append('error: a tool call is {"name": str, "arguments": object}')
            continue
        calls.append(ToolCall(obj["name"], obj.get("arguments", {})))
    return calls


def call_tool(tools: dict[str, Tool], call: ToolCall | str) -> str:
    """The text result of one call; the model's mistakes become ``error: ...`` results."""
    if isinstance(call, str):
        return call
    tool = tools.get(call.name)
    if tool is None:
        return f"error: no tool {call.name!r}; tools: {', '.join(sorted(tools))}"
    required = tool.parameters.get("required", [])
    missing = [k for k in required if k not in call.arguments]
    unknown = [k for k in call.arguments if k not in tool.parameters.get("properties", {})]
    if missing or unknown:
        return f"error: {call.name} arguments: missing {missing}, unknown {unknown}"
    try:
        result = tool.fn(**call.arguments)
    except Exception as err:  # the tool failed on the model's input: the model reads why
        return f"error: {type(err).__name__}: {err}"[:RESULT_CHARS]
    return str(result)[:RESULT_CHARS]
