"""Streamed answers of the agent endpoint: a whole response sent as OpenAI's server-sent events.

A request with ``stream: true`` is sampled and recorded exactly as the same request without
it (``agent_server.py``: the same ids, logprobs, continuation rules and episode record): the
engine samples it whole, and its response is then sent as chunks, not token by token as the
engine samples (``decode_turns`` hands back finished turns only).

* ``/v1/chat/completions``: ``chat.completion.chunk`` objects. Per choice, a first delta with
  the role; a plain answer's text follows one delta per token whose text stands alone (a
  token ending inside a multi-byte character waits for the next); an answer that calls tools
  has its content (if any) in the first delta, then per tool call one delta with its index,
  id, type, name and empty arguments, and one with its arguments. A last chunk per choice has
  an empty delta and the finish reason.
* ``/v1/completions``: ``text_completion`` chunks, the text per token as above, then a chunk
  with empty text and the finish reason.
* ``stream_options.include_usage``: every chunk has ``usage: null``, and a last chunk with no
  choices carries the response's usage. Then ``data: [DONE]``.
* ``/v1/responses`` and ``/v1/messages``: their APIs' events (``agent_responses.py``,
  ``agent_messages.py``), each sent named by its type (``named_events``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from .agent_render import BadRequest


def include_usage(body: dict) -> bool:
    """Whether the request asks for the usage chunk; ``stream_options`` without ``stream``,
    or not an object, is refused (as OpenAI does)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not body.get("stream"):
        raise BadRequest("'stream_options' is allowed only with stream = true")
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object, such as {\"include_usage\": true}")
    return bool(options.get("include_usage"))


def text_pieces(tokenizer, ids: list[int], text: str) -> list[str]:
    """``text``, the decoded ``ids``, in pieces whose concatenation is ``text``: one per token
    whose decoded text continues it, the tokens that do not (a character split across
    tokens) joined to the next; whatever is left in the last piece."""
    pieces: list[str] = []
    at = start = 0
    for end in range(1, len(ids) + 1):
        piece = tokenizer.decode(ids[start:end], skip_special_tokens=True)
        if piece and "\ufffd" not in piece and text.startswith(piece, at):
            pieces.append(piece)
            at, start = at + len(piece), end
    if at < len(text):
        pieces.append(text[at:])
    return pieces


def _chat_deltas(message: dict, tokenizer, ids: list[int]) -> list[dict]:
    calls = message.get("tool_calls")
    if not calls:
        return [{"role": "assistant", "content": ""}] + [
            {"content": p} for p in text_pieces(tokenizer, ids, message["content"])]
    deltas = [{"role": "assistant", "content": message["content"]}]
    for index, call in enumerate(calls):
        function = call["function"]
        deltas.append({"tool_calls": [{"index": index, "id": call["id"], "type": call["type"],
                                       "function": {"name": function["name"],
                                                    "arguments": ""}}]})
        deltas.append({"tool_calls": [{"index": index,
                                       "function": {"arguments": function["arguments"]}}]})
    return deltas


def stream_chunks(response: dict, sampled: list[list[int]], tokenizer,
                  usage: bool) -> list[dict]:
    """The chunks of ``response`` (a ``chat.completion`` or ``text_completion`` as the
    endpoint answers unstreamed), ``sampled`` each choice's ids, ``usage`` whether the usage
    chunk ends them (see the module docstring)."""
    chat = response["object"] == "chat.completion"
    head = {"id": response["id"], "object": "chat.completion.chunk" if chat
            else "text_completion", "created": response["created"],
            "model": response["model"]}
    tail = {"usage": None} if usage else {}
    chunks = []
    for choice, ids in zip(response["choices"], sampled, strict=True):
        if chat:
            parts = [{"delta": d} for d in _chat_deltas(choice["message"], tokenizer, ids)]
            parts.append({"delta": {}})
        else:
            parts = [{"text": p} for p in text_pieces(tokenizer, ids, choice["text"])]
            parts.append({"text": ""})
        for n, part in enumerate(parts):
            finish = choice["finish_reason"] if n == len(parts) - 1 else None
            chunks.append({**head, "choices": [{"index": choice["index"], **part,
                                                "logprobs": None, "finish_reason": finish}],
                           **tail})
    if usage:
        chunks.append({**head, "choices": [], "usage": response["usage"]})
    return chunks


def server_sent_events(chunks: list[dict]) -> Iterator[bytes]:
    """``chunks`` as ``data:`` events, then ``data: [DONE]``."""
    for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n".encode()
    yield b"data: [DONE]\n\n"


def named_events(events: list[dict]) -> Iterator[bytes]:
    """``events`` as server-sent events named by their ``type`` (the Responses and Messages
    APIs' streams: no ``[DONE]``)."""
    for event in events:
        yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
