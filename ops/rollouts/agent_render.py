"""What the agent endpoint does with text: OpenAI requests to prompt ids, sampled ids to
OpenAI messages.

* **prompt ids**: a chat request's messages (and ``tools``) through the chat template — the
  tokenizer's, or the one the run names — with the generation prompt, then tokenized without
  special tokens added; a completions request's prompt as given (text, or token ids). An
  assistant message's ``tool_calls`` reach the template with their ``arguments`` as objects,
  as Hugging Face templates expect (the OpenAI client sends them as JSON text).
* **a conversation continued**: when a chat request's messages are the previous request's,
  one of the assistant messages it was answered with, and new messages, its prompt ids are
  the previous prompt ids, that answer's sampled ids as sampled, and the new messages as
  the chat template renders them after a conversation (``episode.render_messages``,
  tokenized), so the model's own tokens are never re-tokenized from text; any other
  request is templated whole.
* **tool calls**: the sampled text's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks (``tools.parse_tool_calls``: the Hermes format, which the embedded tool task and
  many chat models use) become the message's ``tool_calls``, the text around them its
  ``content``.
* **other APIs**: ``text_of``, ``chat_tool`` and ``require_strings`` read the Responses and
  Messages APIs' text parts and tools as chat's (``agent_responses.py``, ``agent_messages.py``).
* **stop strings**: a sample is cut after the first token whose text completes a stop
  string; its ids end there (finish reason "stop"), so what is recorded is what the agent got.
"""

from __future__ import annotations

import json
from typing import Any

from .episode import render_messages
from .tools import TOOL_CALL, ToolCall, parse_tool_calls


class BadRequest(ValueError):
    """A request the endpoint cannot serve (HTTP 400), with what is wrong in one line."""


def require_strings(item: dict, keys: tuple[str, ...], where: str) -> None:
    """Refuse ``item`` (at ``where`` in the request) unless each of ``keys`` is a string."""
    for key in keys:
        if not isinstance(item.get(key), str):
            raise BadRequest(f"{where}.{key} is required, a string")


def text_of(content: Any, kinds: tuple[str, ...], where: str) -> str:
    """The text of ``content`` (at ``where``): a string, or parts of the ``kinds`` joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in kinds
                                         for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise BadRequest(f"{where} must be a string or a list of {' / '.join(kinds)} parts")


def chat_tool(name: Any, description: Any, parameters: Any) -> dict:
    """A chat request's function tool (keys in the order chat clients send them, so the
    template renders it alike whichever API named it)."""
    function = {"name": name}
    if description:
        function["description"] = description
    function["parameters"] = parameters or {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def _template_messages(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise BadRequest("every message needs a 'role'")
        m = dict(m)
        calls = m.get("tool_calls") or []
        if calls:
            m["tool_calls"] = [_call_for_template(c) for c in calls]
        out.append(m)
    return out


def _call_for_template(call: dict) -> dict:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments else {}
        except json.JSONDecodeError as err:
            raise BadRequest(f"tool call arguments are not JSON: {err}") from None
    function["arguments"] = arguments
    return {**call, "function": function}


def chat_prompt_ids(tokenizer, messages: list[dict], tools: list[dict] | None,
                    chat_template: str | None) -> list[int]:
    """The prompt ids of a chat request (see the module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
    if tools:
        kwargs["tools"] = tools
    if chat_template:
        kwargs["chat_template"] = chat_template
    text = tokenizer.apply_chat_template(_template_messages(messages), **kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def completion_prompt_ids(tokenizer, prompt: Any) -> list[int]:
    """The prompt ids of a completions request: its text tokenized, or its token ids."""
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise BadRequest("'prompt' must be a string or a list of token ids (one prompt)")


def cut_at_stop(tokenizer, ids: list[int], logprobs: list[float], finish: str,
                stop: list[str]) -> tuple[list[int], list[float], str]:
    """``ids`` cut after the first token whose text completes one of ``stop``."""
    if not stop:
        return ids, logprobs, finish
    for end in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:end], skip_special_tokens=True)
        if any(s in text for s in stop):
            return ids[:end], logprobs[:end], "stop"
    return ids, logprobs, finish


def assistant_message(text: str, call_prefix: str) -> tuple[dict, bool]:
    """The OpenAI assistant message of a sampled text, and whether it calls tools; the
    tool calls' ids are ``call_prefix`` and their number. A malformed call stays text."""
    calls = [c for c in parse_tool_calls(text) if isinstance(c, ToolCall)]
    if not calls:
        return {"role": "assistant", "content": text}, False
    content = TOOL_CALL.sub("", text).strip()
    return {"role": "assistant", "content": content or None,
            "tool_calls": [{"id": f"{call_prefix}-{n}", "type": "function",
                            "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                           for n, c in enumerate(calls)]}, True


def _norm(message: dict) -> tuple:
    """A message as the conversation's content: role, text, tool calls, tool call id."""
    calls = tuple((c.get("function", {}).get("name"),
                   json.dumps(_call_for_template(c)["function"]["arguments"], sort_keys=True))
                  for c in message.get("tool_calls") or [])
    return (message.get("role"), message.get("content") or "", calls,
            message.get("tool_call_id") if not calls else None)


def continued_prompt_ids(tokenizer, messages: list[dict], previous: list[dict],
                         prompt_ids: list[int], answers: list[tuple[dict, list[int]]],
                         chat_template: str | None) -> list[int] | None:
    """The prompt ids of a request continuing the previous one (see the module docstring):
    ``previous`` its messages, ``prompt_ids`` its prompt ids, ``answers`` each returned
    message with its sampled ids; None when ``messages`` does not continue it."""
    n = len(previous)
    if len(messages) < n + 2 or [_norm(m) for m in messages[:n]] != [_norm(m) for m in previous]:
        return None
    sent = _norm(messages[n])
    for message, ids in answers:
        if _norm(message) == sent:
            text = render_messages(tokenizer, _template_messages(messages[n + 1:]),
                                   chat_template)
            return prompt_ids + ids + tokenizer(text, add_special_tokens=False)["input_ids"]
    return None
