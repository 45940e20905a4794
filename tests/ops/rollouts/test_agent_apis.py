"""The OpenAI Responses API (``/v1/responses``) and the Anthropic Messages API
(``/v1/messages``) on the agent endpoint, spoken by the real ``openai`` and ``anthropic``
clients: a conversation is recorded token for token as the same conversation sent as chat
completions, and each API's streams assemble to its unstreamed answers. The tool calls come
from ``test_agent_stream``'s model fitted to call ``lookup`` greedily."""

from __future__ import annotations

import json
from dataclasses import replace

import anthropic
import openai
import pytest
from test_agent_stream import ASK, LOOKUP, tool_caller  # noqa: F401 (a fixture)

from rlhfless.ops.engine.backend import HFBackend
from rlhfless.ops.rollouts.agent_server import AgentEndpoint

FUNCTION = LOOKUP["function"]
RESULT, FOLLOW_UP = "fig pear", "And box 8?"


@pytest.fixture(scope="module")
def server():
    endpoint = AgentEndpoint()
    endpoint.start()
    yield endpoint
    endpoint.stop()


@pytest.fixture(scope="module")
def engine(model64, tokenizer):
    return HFBackend.of_model(model64, tokenizer)


def _serve(server: AgentEndpoint, engine) -> None:
    server.set_engine(engine, replace(server.sampling, max_new_tokens=80, seed=11), None)


def _recorded(server: AgentEndpoint, token: str) -> list:
    return [(c.prompt_ids, c.samples) for c in server.close_episode(token)]


def _openai(server: AgentEndpoint, key: int) -> tuple[openai.OpenAI, str]:
    token = server.open_episode(key)
    return openai.OpenAI(base_url=server.base_url, api_key=token, max_retries=0,
                         timeout=30), token


def _anthropic(server: AgentEndpoint, key: int) -> tuple[anthropic.Anthropic, str]:
    token = server.open_episode(key)
    return anthropic.Anthropic(base_url=server.base_url.removesuffix("/v1"), api_key=token,
                               max_retries=0, timeout=30), token


def by_chat(server, tools: bool, **sampling) -> tuple[list, list]:
    client, token = _openai(server, key=5)
    messages, texts = list(ASK), []
    extra = {"tools": [LOOKUP]} if tools else {}
    for _ in range(2):
        reply = client.chat.completions.create(model="m", messages=messages, **extra,
                                               **sampling).choices[0].message
        texts.append((reply.content or "", [(c.function.name, json.loads(c.function.arguments))
                                            for c in reply.tool_calls or []]))
        messages.append(reply.model_dump(exclude_none=True,
                                         include={"role", "content", "tool_calls"}))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": RESULT}
                     for c in reply.tool_calls or []] \
            or [{"role": "user", "content": FOLLOW_UP}]
    return texts, _recorded(server, token)


def by_responses(server, tools: bool, max_tokens: int, **sampling) -> tuple[list, list]:
    client, token = _openai(server, key=5)
    items, texts = list(ASK), []
    extra = {"tools": [{"type": "function", **FUNCTION}]} if tools else {}
    for _ in range(2):
        response = client.responses.create(model="m", input=items, max_output_tokens=max_tokens,
                                           **extra, **sampling)
        calls = [o for o in response.output if o.type == "function_call"]
        texts.append((response.output_text, [(c.name, json.loads(c.arguments))
                                              for c in calls]))
        items += [o.model_dump(exclude_none=True) for o in response.output]
        items += [{"type": "function_call_output", "call_id": c.call_id, "output": RESULT}
                  for c in calls] or [{"role": "user", "content": FOLLOW_UP}]
    return texts, _recorded(server, token)


def by_messages(server, tools: bool, max_tokens: int, **sampling) -> tuple[list, list]:
    """(the client takes no ``temperature``: it goes as an extra field, which we serve)"""
    client, token = _anthropic(server, key=5)
    messages, texts = list(ASK), []
    extra = {"tools": [{"name": FUNCTION["name"], "description": FUNCTION["description"],
                        "input_schema": FUNCTION["parameters"]}]} if tools else {}
    for _ in range(2):
        message = client.messages.create(model="m", messages=messages, max_tokens=max_tokens,
                                         **extra, extra_body=sampling)
        uses = [b for b in message.content if b.type == "tool_use"]
        texts.append(("".join(b.text for b in message.content if b.type == "text"),
                      [(b.name, b.input) for b in uses]))
        messages.append({"role": "assistant",
                         "content": [b.model_dump(exclude_none=True) for b in message.content]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": b.id, "content": RESULT} for b in uses]
            or FOLLOW_UP})
    return texts, _recorded(server, token)


@pytest.mark.parametrize("tools", [True, False], ids=["tool call", "text"])
def test_a_conversation_is_recorded_the_same_whichever_api_the_agent_speaks(
        server, engine, tool_caller, tools):  # noqa: F811
    """The same two-turn conversation (a tool call and its result, or an answer and a user
    message) sent as chat completions, as responses and as messages, in episodes of the same
    sampling key: the same answers, and the same recorded prompt ids, sampled ids, logprobs
    and finish reasons, the second request continuing the first's sampled ids."""
    _serve(server, tool_caller if tools else engine)
    sampling = {"temperature": 0} if tools else {"temperature": 1.0}
    chat = by_chat(server, tools, max_tokens=80 if tools else 8, **sampling)
    responses = by_responses(server, tools, 80 if tools else 8, **sampling)
    messages = by_messages(server, tools, 80 if tools else 8, **sampling)
    assert responses == chat and messages == chat
    texts, [(p1, [(s1, _, _)]), (p2, _)] = chat
    assert p2[:len(p1) + len(s1)] == p1 + s1 and len(p2) > len(p1) + len(s1)
    if tools:
        assert texts[0] == ("", [("lookup", {"box": "7"})])
    else:
        assert all(text for text, _ in texts)
