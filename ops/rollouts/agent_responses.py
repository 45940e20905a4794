"""The OpenAI Responses API on the agent endpoint: ``POST /v1/responses`` served as the chat
request it amounts to.

A request becomes a chat request (``chat_request``) that the endpoint templates, continues,
samples and records exactly as the same conversation sent to ``/v1/chat/completions``
(``agent_server.py``); its one answer becomes a ``response`` object (``response_object``).

* **in**: ``instructions`` is a first ``system`` message; ``input`` a string (one user
  message) or a list of items: ``message`` items (with or without ``type``; roles user,
  assistant, system, and developer as system; content a string or ``input_text`` /
  ``output_text`` parts), ``function_call`` items (the tool calls of the assistant message
  before them, or of a new one) and ``function_call_output`` items (``tool`` messages).
  ``tools`` of type ``function``, ``tool_choice`` "auto" / "none", ``max_output_tokens``,
  ``temperature``, ``top_p``.
* **out**: ``output`` holds a ``message`` item with one ``output_text`` part (unless the answer
  is only tool calls), then a ``function_call`` item per tool call, its ``call_id`` the chat
  answer's tool call id; ``status`` is "incomplete" (``incomplete_details.reason``
  "max_output_tokens") when the token budget ended the answer; ``usage`` counts tokens.
* **stream**: ``response.created``, ``response.in_progress``, per output item
  ``response.output_item.added``, its content (``response.content_part.added``,
  ``response.output_text.delta`` per token's text as chat streams it, ``.done`` events; or
  ``response.function_call_arguments.delta`` / ``.done``), ``response.output_item.done``, then
  ``response.completed`` (or ``response.incomplete``), each with its ``sequence_number``.

Not served (400): ``previous_response_id`` and ``conversation`` (the endpoint stores no
responses), other item types (reasoning, built-in tool calls), tools other than functions.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from .agent_render import BadRequest, chat_tool, require_strings, text_of
from .agent_stream import text_pieces

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
ITEM_TYPES = ("message", "function_call", "function_call_output")


def _text(content: Any, where: str) -> str:
    return text_of(content, ("input_text", "output_text"), where)


def _messages(items: Any) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadRequest("'input' must be a string or a non-empty list of items")
    messages: list[dict] = []
    for n, item in enumerate(items):
        where = f"input[{n}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = _ROLES.get(item.get("role"))
            if role is None:
                raise BadRequest(f"{where}.role = {item.get('role')!r}: allowed "
                                 f"{', '.join(_ROLES)}")
            messages.append({"role": role,
                             "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            require_strings(item, ("call_id", "name"), where)
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"),
                                 "arguments": item.get("arguments") or "{}"}}
            last = messages[-1] if messages else {}
            if last.get("role") == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            require_strings(item, ("call_id",), where)
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output", ""), f"{where}.output")})
        else:
            raise BadRequest(f"{where}: item type {kind!r} is not served; allowed "
                             f"{', '.join(ITEM_TYPES)}")
    return messages


def _tools(tools: Any) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for n, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise BadRequest(f"tools[{n}]: type {kind!r} is not served; allowed 'function'")
        require_strings(tool, ("name",), f"tools[{n}]")
        out.append(chat_tool(tool.get("name"), tool.get("description"),
                             tool.get("parameters")))
    return out


def chat_request(body: dict) -> dict:
    """The chat request a Responses API request ``body`` amounts to."""
    for key in ("previous_response_id", "conversation"):
        if body.get(key):
            raise BadRequest(f"'{key}' is not served: the endpoint stores no responses; send "
                             "the whole conversation as 'input'")
    budget = body.get("max_output_tokens")
    if budget is not None and (not isinstance(budget, int) or budget < 1):
        raise BadRequest(f"max_output_tokens = {budget!r}: allowed a positive integer")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    messages += _messages(body.get("input"))
    tool_choice = body.get("tool_choice")
    return {"messages": messages, "tools": _tools(body.get("tools")),
            "tool_choice": "none" if tool_choice == "none" else "auto",
            "max_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature"),
            "top_p": body.get("top_p")}


def response_object(body: dict, model: str, prompt_tokens: int, sampled: list[int],
                    choice: dict) -> dict:
    """The ``response`` object of the chat answer ``choice`` (its ``message`` and
    ``finish_reason``), ``sampled`` its ids."""
    message, output = choice["message"], []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        output.append({"id": f"msg_{secrets.token_hex(8)}", "type": "message",
                       "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": message.get("content") or "",
                                    "annotations": [], "logprobs": []}]})
    output += [{"id": f"fc_{secrets.token_hex(8)}", "type": "function_call",
                "status": "completed", "call_id": c["id"], "name": c["function"]["name"],
                "arguments": c["function"]["arguments"]} for c in calls]
    cut = choice["finish_reason"] == "length"
    return {"id": f"resp_{secrets.token_hex(8)}", "object": "response",
            "created_at": int(time.time()), "model": model,
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "error": None, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "parallel_tool_calls": True, "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [], "output": output,
            "usage": {"input_tokens": prompt_tokens,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": len(sampled),
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": prompt_tokens + len(sampled)}}


def _item_events(item: dict, index: int, tokenizer, sampled: list[int],
                 plain: bool) -> list[dict]:
    at = {"item_id": item["id"], "output_index": index}
    if item["type"] == "function_call":
        return [{"type": "response.output_item.added", "output_index": index,
                 "item": {**item, "status": "in_progress", "arguments": ""}},
                {"type": "response.function_call_arguments.delta", **at,
                 "delta": item["arguments"]},
                {"type": "response.function_call_arguments.done", **at,
                 "name": item["name"], "arguments": item["arguments"]}]
    part = item["content"][0]
    text = part["text"]
    pieces = text_pieces(tokenizer, sampled, text) if plain else [text]
    at["content_index"] = 0
    return [{"type": "response.output_item.added", "output_index": index,
             "item": {**item, "status": "in_progress", "content": []}},
            {"type": "response.content_part.added", **at, "part": {**part, "text": ""}}] \
        + [{"type": "response.output_text.delta", **at, "delta": p, "logprobs": []}
           for p in pieces if p] \
        + [{"type": "response.output_text.done", **at, "text": text, "logprobs": []},
           {"type": "response.content_part.done", **at, "part": part}]


def response_events(response: dict, sampled: list[int], tokenizer) -> list[dict]:
    """The Responses API's stream events of ``response``, ``sampled`` its answer's ids (see
    the module docstring)."""
    started = {**response, "status": "in_progress", "incomplete_details": None,
               "output": [], "usage": None}
    events = [{"type": "response.created", "response": started},
              {"type": "response.in_progress", "response": started}]
    plain = len(response["output"]) == 1  # a text answer: its text is the sampled ids'
    for index, item in enumerate(response["output"]):
        events += _item_events(item, index, tokenizer, sampled, plain)
        events.append({"type": "response.output_item.done", "output_index": index,
                       "item": item})
    events.append({"type": f"response.{response['status']}", "response": response})
    return [{**e, "sequence_number": n} for n, e in enumerate(events)]

