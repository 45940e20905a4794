"""The OpenAI Responses API (``/v1/responses``) and the Anthropic Messages API
(``/v1/messages``) on the agent endpoint, spoken by the real ``openai`` and ``anthropic``
clients: a conversation is recorded token for token as the same conversation sent as chat
completions, and each API's streams assemble to its unstreamed answers. The tool calls come
from ``test_agent_stream``'s model fitted to call ``lookup`` greedily."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from test_agent_stream import ASK, LOOKUP, tool_caller  # noqa: F401 (a fixture)

from rlhfless.ops.engine.engine_types import SamplingParams
from rlhfless.ops.rollouts.agent import AgentParams, run_agent_episodes
from rlhfless.ops.rollouts.agent_server import AgentEndpoint

FUNCTION = LOOKUP["function"]
RESULT, FOLLOW_UP = "fig pear", "And box 8?"


def _serve(server: AgentEndpoint, engine) -> None:
    server.set_engine(engine, SamplingParams(max_new_tokens=80, seed=11), None)


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


def by_responses(server, tools: bool, max_tokens: int, events: list | None = None,
                 **sampling) -> tuple[list, list]:
    """The conversation as responses; streamed (``stream=True``, the response its last event
    carries, its text the text deltas') when ``events`` collects the stream's events."""
    client, token = _openai(server, key=5)
    items, texts = list(ASK), []
    extra = {"tools": [{"type": "function", **FUNCTION}]} if tools else {}
    for _ in range(2):
        request = {"model": "m", "input": items, "max_output_tokens": max_tokens, **extra,
                   **sampling}
        if events is None:
            response = client.responses.create(**request)
        else:
            stream = list(client.responses.create(stream=True, **request))
            events.append([(e.type, e.sequence_number) for e in stream])
            response = stream[-1].response
            assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") \
                == response.output_text
        calls = [o for o in response.output if o.type == "function_call"]
        texts.append((response.output_text, [(c.name, json.loads(c.arguments))
                                              for c in calls]))
        items += [o.model_dump(exclude_none=True) for o in response.output]
        items += [{"type": "function_call_output", "call_id": c.call_id, "output": RESULT}
                  for c in calls] or [{"role": "user", "content": FOLLOW_UP}]
    return texts, _recorded(server, token)


def by_messages(server, tools: bool, max_tokens: int, events: list | None = None,
                **sampling) -> tuple[list, list]:
    """The conversation as messages; streamed (``messages.stream``, its final message) when
    ``events`` collects the stream's events. (The client takes no ``temperature``: it goes as
    an extra field, which we serve.)"""
    client, token = _anthropic(server, key=5)
    messages, texts = list(ASK), []
    extra = {"tools": [{"name": FUNCTION["name"], "description": FUNCTION["description"],
                        "input_schema": FUNCTION["parameters"]}]} if tools else {}
    for _ in range(2):
        request = {"model": "m", "messages": messages, "max_tokens": max_tokens, **extra,
                   "extra_body": sampling}
        if events is None:
            message = client.messages.create(**request)
        else:
            with client.messages.stream(**request) as stream:
                events.append([e.type for e in stream])
                message = stream.get_final_message()
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


@pytest.mark.parametrize("tools", [True, False], ids=["tool call", "text"])
def test_streamed_responses_and_messages_assemble_to_the_unstreamed_ones(
        server, engine, tool_caller, tools):  # noqa: F811
    """The conversation above streamed (the ``openai`` client's ``stream=True``, the
    ``anthropic`` client's ``messages.stream`` assembling the message from the deltas): the
    same answers and the same record as unstreamed; a text answer comes in more than one
    text delta, a tool call's arguments in one."""
    _serve(server, tool_caller if tools else engine)
    sampling = {"temperature": 0} if tools else {"temperature": 1.0}
    max_tokens = 80 if tools else 8
    for speak in (by_responses, by_messages):
        events: list = []
        assert speak(server, tools, max_tokens, events, **sampling) == \
            speak(server, tools, max_tokens, **sampling)
        if speak is by_responses:
            assert all([n for _, n in turn] == list(range(len(turn))) for turn in events)
            kinds = [[kind for kind, _ in turn] for turn in events]
            assert all(k[:2] == ["response.created", "response.in_progress"] for k in kinds)
            assert all(k[-1] in ("response.completed", "response.incomplete") for k in kinds)
        else:
            kinds = events
            assert all(k[0] == "message_start" and k[-2:] == ["message_delta", "message_stop"]
                       for k in kinds)
        deltas = [sum(k.count(d) for d in ("response.output_text.delta", "content_block_delta",
                                           "response.function_call_arguments.delta"))
                  for k in kinds]
        assert deltas[0] == 1 if tools else all(d > 1 for d in deltas)


def test_stop_reasons_and_usage_are_each_apis_own(server, engine):
    """A budget that ends the answer: the response is "incomplete" (max_output_tokens), the
    message stops on "max_tokens"; a stop sequence the text holds: "stop_sequence", with it;
    usage counts the recorded prompt and sampled ids."""
    _serve(server, engine)
    client, token = _openai(server, key=2)
    cut = client.responses.create(model="m", input="Items: fig pear", max_output_tokens=2,
                                  temperature=1.0)
    [call] = _recorded(server, token)
    prompt_ids, [(sampled, _, _)] = call
    assert (cut.status, cut.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert (cut.usage.input_tokens, cut.usage.output_tokens) == \
        (len(prompt_ids), len(sampled)) == (cut.usage.input_tokens, 2)
    client, token = _anthropic(server, key=2)
    message = client.messages.create(model="m", max_tokens=2, extra_body={"temperature": 1.0},
                                     messages=[{"role": "user", "content": "Items: fig pear"}])
    assert _recorded(server, token) == [call]
    assert message.stop_reason == "max_tokens" and message.content[0].text == cut.output_text
    assert (message.usage.input_tokens, message.usage.output_tokens) == \
        (len(prompt_ids), 2)
    stop = message.content[0].text.strip()[0]  # drawn again under the same key: it stops there
    client, token = _anthropic(server, key=2)
    stopped = client.messages.create(model="m", max_tokens=2, stop_sequences=[stop],
                                     extra_body={"temperature": 1.0},
                                     messages=[{"role": "user", "content": "Items: fig pear"}])
    server.close_episode(token)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    # cut after the token that completed it, as chat completions are: what was recorded
    assert stop in stopped.content[0].text and len(stopped.content[0].text) <= len(
        message.content[0].text) and stopped.usage.output_tokens == 1


def test_bad_requests_get_a_400_in_each_apis_error_shape_and_sample_nothing(server, engine):
    _serve(server, engine)
    client, token = _openai(server, key=1)
    with pytest.raises(openai.BadRequestError,
                       match=r"input\[1\]: item type 'reasoning' is not served; allowed "
                             "message, function_call, function_call_output"):
        client.responses.create(model="m", input=[{"role": "user", "content": "x"},
                                                  {"type": "reasoning", "summary": []}])
    with pytest.raises(openai.BadRequestError, match=r"input\[0\]\.call_id is required"):
        client.responses.create(model="m", input=[{"type": "function_call", "name": "lookup",
                                                   "arguments": "{}"}])
    with pytest.raises(openai.BadRequestError, match="'previous_response_id' is not served"):
        client.responses.create(model="m", input="x", previous_response_id="resp_1")
    assert server.close_episode(token) == []
    client, token = _anthropic(server, key=1)
    with pytest.raises(anthropic.BadRequestError,
                       match=r"messages\[0\]\.content\[0\]: block type 'image' is not served"):
        client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])
    with pytest.raises(anthropic.BadRequestError,
                       match=r"messages\[0\]\.content\[0\]: block type 'tool_use' is not "
                             "served in a user message; allowed text, tool_result"):
        client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "tool_use", "id": "t", "name": "lookup", "input": {}}]}])
    bare = httpx.post(f"{server.base_url}/messages", headers={"x-api-key": token},
                      json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert bare.status_code == 400 and bare.json() == {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "max_tokens = None: required, a positive integer"}}
    assert server.close_episode(token) == []


def test_messages_take_the_episodes_key_as_x_api_key_or_bearer(server, engine):
    _serve(server, engine)
    token = server.open_episode(4)
    request = {"model": "m", "max_tokens": 2,
               "messages": [{"role": "user", "content": "Items: fig"}]}
    url = f"{server.base_url}/messages"
    assert httpx.post(url, headers={"Authorization": f"Bearer {token}"},
                      json=request).json()["type"] == "message"
    refused = httpx.post(url, headers={"x-api-key": "not-the-key"}, json=request)
    assert refused.status_code == 401 and refused.json()["error"]["type"] == \
        "authentication_error"
    wrong = anthropic.Anthropic(base_url=server.base_url.removesuffix("/v1"),
                                api_key="not-the-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(**request)
    assert len(server.close_episode(token)) == 1  # only the authorised request was served
    with pytest.raises(openai.AuthenticationError):  # the same for responses
        openai.OpenAI(base_url=server.base_url, api_key="not-the-key", max_retries=0) \
            .responses.create(model="m", input="x")


def test_agents_speaking_each_api_train_on_the_same_trajectories(engine, make_prompts):
    """The two-turn agent of ``test_agent`` written against chat completions, the Responses
    API and the Messages API (``tests/openai_agents.py``), run as agent episodes in the agent
    process (one at a time, so each request is sampled alone): the same rows, token for
    token, with the same loss masks, behaviour logprobs and rewards."""
    prompts = make_prompts(["Items: fig pear\nAnswer:"])
    columns = ["prompt_ids", "response_ids", "loss_mask", "logprobs", "env_reward", "turns"]
    tables = [run_agent_episodes(engine, prompts, 2, SamplingParams(max_new_tokens=8, seed=3),
                                 AgentParams(f"openai_agents:{agent}", concurrency=1))[0]
              .select(columns).to_pylist()
              for agent in ("two_turns", "two_turns_as_responses", "two_turns_as_messages")]
    assert tables[1] == tables[0] and tables[2] == tables[0]
    assert [row["turns"] for row in tables[0]] == [2] * 2
    assert all(0 in row["loss_mask"] for row in tables[0])  # the agent's tokens, masked
