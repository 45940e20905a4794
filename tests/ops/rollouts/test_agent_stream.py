"""Streamed requests to the agent endpoint, read by the real ``openai`` client (``stream=True``;
chat chunks assembled by the client's own ``ChatCompletionStreamState``): what the chunks
assemble to is what the same request unstreamed returns, and the streamed episode's record
(prompt ids, sampled ids, logprobs, finish reasons, the continued conversation) is the
unstreamed one's. Two episodes under the same sampling key draw the same samples, so each
pair below samples at temperature 1, except the tool call, which a model fitted to one call
emits greedily."""

from __future__ import annotations

import copy
import json

import openai
import pytest
import torch
from openai.lib.streaming.chat import ChatCompletionStreamState

from rlhfless.ops.engine.backend import HFBackend
from rlhfless.ops.engine.engine_types import SamplingParams
from rlhfless.ops.rollouts.agent_server import AgentEndpoint
from rlhfless.ops.rollouts.agent_stream import text_pieces

SAMPLING = SamplingParams(max_new_tokens=8, seed=11)
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "List the items in a box.",
    "parameters": {"type": "object", "properties": {"box": {"type": "string"}},
                   "required": ["box"]}}}
ASK = [{"role": "user", "content": "Items in box 7?"}]
CALL = "<tool_call>" + json.dumps({"name": "lookup", "arguments": {"box": "7"}}) + "</tool_call>"


@pytest.fixture(scope="module")
def tool_caller(model, tokenizer):
    """The tiny model fitted to answer ``ASK`` (with ``LOOKUP`` offered) with ``CALL``, until
    its most likely token at every step of the call is the call's own (then greedy decoding
    emits it)."""
    prompt = tokenizer(tokenizer.apply_chat_template(ASK, tools=[LOOKUP], tokenize=False,
                                                     add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"]
    call = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    net = copy.deepcopy(model).train()
    ids, labels = torch.tensor([prompt + call]), torch.tensor([[-100] * len(prompt) + call])
    optimizer = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(100):
        with torch.no_grad():
            if net(input_ids=ids).logits[0, len(prompt) - 1:-1].argmax(-1).tolist() == call:
                return HFBackend.of_model(net.eval(), tokenizer)
        optimizer.zero_grad()
        net(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
    raise AssertionError("the model did not fit the tool call in 100 steps")


def _client(server: AgentEndpoint, key: int) -> tuple[openai.OpenAI, str]:
    token = server.open_episode(key)
    return openai.OpenAI(base_url=server.base_url, api_key=token, max_retries=0,
                         timeout=30), token


def _recorded(server: AgentEndpoint, token: str) -> list:
    return [(c.prompt_ids, c.samples) for c in server.close_episode(token)]


def _assembled(chunks):
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.current_completion_snapshot


def _answer(choice) -> tuple:
    m = choice.message
    calls = [(c.id, c.type, c.function.name, c.function.arguments) for c in m.tool_calls or []]
    return m.role, m.content, calls, choice.finish_reason


def _conversation(server: AgentEndpoint, stream: bool, **request) -> tuple[list, list]:
    """Two requests of one conversation (the first answer, and a tool result for each of its
    tool calls or a user message, go back); each answer as (role, content, tool calls,
    finish), and the episode's record."""
    client, token = _client(server, key=5)
    messages, answers = list(ASK), []
    for _ in range(2):
        if stream:
            chunks = list(client.chat.completions.create(
                model="m", messages=messages, stream=True,
                stream_options={"include_usage": True}, **request))
            assert all(c.object == "chat.completion.chunk" for c in chunks)
            assert chunks[-1].choices == [] and chunks[-1].usage is not None
            reply = _assembled(chunks)
        else:
            reply = client.chat.completions.create(model="m", messages=messages, **request)
        answers.append((*_answer(reply.choices[0]), reply.usage.model_dump()))
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True, include={
            "role", "content", "tool_calls"}))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": "fig pear"}
                     for c in message.tool_calls or []] \
            or [{"role": "user", "content": "And box 8?"}]
    return answers, _recorded(server, token)


def test_a_streamed_chat_assembles_to_the_unstreamed_answer_and_records_the_same(server,
                                                                               engine):
    server.set_engine(engine, SAMPLING, None)
    streamed, streamed_calls = _conversation(server, True, temperature=1.0, max_tokens=8)
    plain, plain_calls = _conversation(server, False, temperature=1.0, max_tokens=8)
    assert streamed == plain and streamed_calls == plain_calls
    (p1, [(s1, _, _)]), (p2, _) = plain_calls
    assert p2[:len(p1) + len(s1)] == p1 + s1  # the streamed answer continued as sampled


def test_a_streamed_tool_call_assembles_to_the_unstreamed_one(server, tool_caller):
    server.set_engine(tool_caller, SAMPLING, None)
    streamed, streamed_calls = _conversation(server, True, tools=[LOOKUP], temperature=0,
                                             max_tokens=80)
    plain, plain_calls = _conversation(server, False, tools=[LOOKUP], temperature=0,
                                       max_tokens=80)
    assert streamed == plain and streamed_calls == plain_calls
    role, content, calls, finish, _ = plain[0]
    assert (role, content, finish) == ("assistant", None, "tool_calls")
    assert [(name, json.loads(args)) for _, kind, name, args in calls] == \
        [("lookup", {"box": "7"})] and calls[0][1] == "function"
    (p1, [(s1, _, _)]), (p2, _) = plain_calls
    assert p2[:len(p1) + len(s1)] == p1 + s1  # the streamed tool call continued as sampled


def test_streamed_completions_assemble_to_the_unstreamed_texts(server, engine):
    server.set_engine(engine, SAMPLING, None)
    request = {"model": "m", "prompt": "Items: fig pear\nAnswer:", "n": 2, "max_tokens": 8,
               "temperature": 1.0}
    client, token = _client(server, key=9)
    chunks = list(client.completions.create(stream=True, **request))
    streamed_calls = _recorded(server, token)
    client, token = _client(server, key=9)
    plain = client.completions.create(**request)
    plain_calls = _recorded(server, token)
    assert streamed_calls == plain_calls
    assert all(c.object == "text_completion" and c.usage is None for c in chunks)
    for choice in plain.choices:
        mine = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) \
            + [choice.finish_reason]
        assert len(mine) > 2  # the text came in more than one piece


def test_stream_options_are_refused_without_stream(server, engine):
    server.set_engine(engine, SAMPLING, None)
    client, token = _client(server, key=1)
    with pytest.raises(openai.BadRequestError, match="only with stream = true"):
        client.completions.create(model="m", prompt="x", max_tokens=2,
                                  stream_options={"include_usage": True})
    assert server.close_episode(token) == []


def test_text_pieces_join_to_the_text_and_split_no_character(tokenizer):
    text = "Items: fig \u00e9t\u00e9 \u2713 pear"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = text_pieces(tokenizer, ids, tokenizer.decode(ids, skip_special_tokens=True))
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert len(pieces) > 3
