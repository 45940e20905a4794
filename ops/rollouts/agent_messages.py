"""The Anthropic Messages API on the agent endpoint: ``POST /v1/messages`` served as the chat
request it amounts to.

A request becomes a chat request (``chat_request``) that the endpoint templates, continues,
samples and records exactly as the same conversation sent to ``/v1/chat/completions``
(``agent_server.py``); its one answer becomes a ``message`` object (``message_object``).

* **in**: ``system`` (a string or ``text`` blocks) is a first ``system`` message; each of
  ``messages`` (roles user and assistant) has a string or content blocks: ``text``,
  ``tool_use`` (an assistant message's tool calls, their ``input`` the arguments) and
  ``tool_result`` (a ``tool`` message each, before the user's text; content a string or
  ``text`` blocks). ``tools`` (``name``, ``description``, ``input_schema``), ``tool_choice``
  ``{"type": "none"}`` or any other (as "auto"), ``max_tokens`` (required),
  ``stop_sequences``, ``temperature``, ``top_p``.
* **out**: ``content`` holds a ``text`` block (unless the answer is only tool calls), then a
  ``tool_use`` block per tool call (``id``, ``name``, ``input``); ``stop_reason`` is
  "tool_use", "max_tokens", "stop_sequence" (with ``stop_sequence``, the one the text holds:
  the answer is cut after the token that completed it and keeps that token, as recorded and
  as chat completions here are) or "end_turn"; ``usage`` counts tokens.
* **stream**: ``message_start``, per block ``content_block_start``, ``content_block_delta``
  (``text_delta`` per token's text as chat streams it, or one ``input_json_delta``),
  ``content_block_stop``; then ``message_delta`` (stop reason, output tokens) and
  ``message_stop``.

Not served (400): other block types (images, documents, thinking), tools without
``input_schema`` (Anthropic's built-in tools), a request without ``max_tokens``.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from .agent_render import BadRequest, chat_tool, require_strings, text_of
from .agent_stream import text_pieces


def _text(content: Any, where: str) -> str:
    return text_of(content, ("text",), where)


def _turn(message: Any, where: str) -> list[dict]:
    """The chat messages of one Messages API message."""
    role = message.get("role") if isinstance(message, dict) else None
    if role not in ("user", "assistant"):
        raise BadRequest(f"{where}.role = {role!r}: allowed user, assistant")
    content = message.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(blocks, list):
        raise BadRequest(f"{where}.content must be a string or a list of content blocks")
    allowed = ("text", "tool_use") if role == "assistant" else ("text", "tool_result")
    texts, calls, results = [], [], []
    for n, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in allowed:
            raise BadRequest(f"{where}.content[{n}]: block type {kind!r} is not served in a "
                             f"{role} message; allowed {', '.join(allowed)}")
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use":
            require_strings(block, ("id", "name"), f"{where}.content[{n}]")
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"),
                                       "arguments": block.get("input") or {}}})
        else:
            require_strings(block, ("tool_use_id",), f"{where}.content[{n}]")
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": _text(block.get("content", ""),
                                             f"{where}.content[{n}].content")})
    if role == "assistant":
        return [{"role": "assistant", "content": "".join(texts) or None, "tool_calls": calls}
                if calls else {"role": "assistant", "content": "".join(texts)}]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts else [])


def _tools(tools: Any) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for n, tool in enumerate(tools):
        if not isinstance(tool, dict) or "input_schema" not in tool:
            raise BadRequest(f"tools[{n}]: only custom tools (name, description, "
                             "input_schema) are served")
        require_strings(tool, ("name",), f"tools[{n}]")
        out.append(chat_tool(tool.get("name"), tool.get("description"),
                             tool["input_schema"]))
    return out


def chat_request(body: dict) -> dict:
    """The chat request a Messages API request ``body`` amounts to."""
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadRequest(f"max_tokens = {max_tokens!r}: required, a positive integer")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    system = body.get("system")
    chat = [{"role": "system", "content": _text(system, "system")}] if system else []
    for n, message in enumerate(messages):
        chat += _turn(message, f"messages[{n}]")
    stop = body.get("stop_sequences") or []
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("'stop_sequences' must be a list of strings")
    choice = body.get("tool_choice")
    return {"messages": chat, "tools": _tools(body.get("tools")),
            "tool_choice": "none" if isinstance(choice, dict) and choice.get("type") == "none"
            else "auto", "max_tokens": max_tokens, "stop": stop,
            "temperature": body.get("temperature"), "top_p": body.get("top_p")}


def _stop(choice: dict, stop: list[str]) -> tuple[str, str | None]:
    """The stop reason of the chat answer ``choice``, and the stop sequence it ended on."""
    finish, text = choice["finish_reason"], choice["message"].get("content") or ""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    found = [(text.find(s), s) for s in stop if s in text]
    return ("stop_sequence", min(found)[1]) if found else ("end_turn", None)


def message_object(body: dict, model: str, prompt_tokens: int, sampled: list[int],
                   choice: dict) -> dict:
    """The ``message`` object of the chat answer ``choice`` (its ``message`` and
    ``finish_reason``), ``sampled`` its ids."""
    message = choice["message"]
    calls = message.get("tool_calls") or []
    content = [{"type": "text", "text": message.get("content") or ""}] \
        if message.get("content") or not calls else []
    content += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                 "input": json.loads(c["function"]["arguments"])} for c in calls]
    reason, sequence = _stop(choice, body.get("stop_sequences") or [])
    return {"id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant",
            "model": model, "content": content, "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": len(sampled)}}


def message_events(message: dict, sampled: list[int], tokenizer) -> list[dict]:
    """The Messages API's stream events of ``message``, ``sampled`` its ids (see the module
    docstring)."""
    usage = message["usage"]
    events = [{"type": "message_start", "message": {
        **message, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": usage["input_tokens"], "output_tokens": 0}}}]
    plain = len(message["content"]) == 1  # a text answer: its text is the sampled ids'
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            text = block["text"]
            pieces = text_pieces(tokenizer, sampled, text) if plain else [text]
            events.append({"type": "content_block_start", "index": index,
                           "content_block": {"type": "text", "text": ""}})
            events += [{"type": "content_block_delta", "index": index,
                        "delta": {"type": "text_delta", "text": p}} for p in pieces if p]
        else:
            events += [{"type": "content_block_start", "index": index,
                        "content_block": {**block, "input": {}}},
                       {"type": "content_block_delta", "index": index,
                        "delta": {"type": "input_json_delta",
                                  "partial_json": json.dumps(block["input"])}}]
        events.append({"type": "content_block_stop", "index": index})
    return events + [{"type": "message_delta",
                      "delta": {"stop_reason": message["stop_reason"],
                                "stop_sequence": message["stop_sequence"]},
                      "usage": {"output_tokens": usage["output_tokens"]}},
                     {"type": "message_stop"}]
