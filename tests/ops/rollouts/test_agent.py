"""Agent episodes against the OpenAI-compatible endpoint, with the real ``openai`` client in
the agent process (``tests/openai_agents.py``) and our engine on the tiny model: trajectories are
the recorded token ids in order, agent-side tokens take no part in the loss, a request
without its episode's key is refused, and a failing agent ends only its own episode."""

from __future__ import annotations

import copy
import time

import httpx
import openai
import pyarrow as pa
import pytest
import torch

from rlhfless.ops.algo.update import UpdateParams, update_policy
from rlhfless.ops.engine import phases
from rlhfless.ops.engine.engine_types import SamplingParams
from rlhfless.ops.engine.forward import response_logprobs
from rlhfless.ops.engine.gen_stats import GenerationStats
from rlhfless.ops.engine.rows import expand_samples
from rlhfless.ops.rollouts.agent import (
    AgentParams,
    agent_rows,
    endpoint,
    play_agents,
    run_agent_episodes,
)

TEXTS = ["Items: fig pear\nAnswer:", "Items: plum\nAnswer:", "Count: kiwi lime\nAnswer:"]
SAMPLING = SamplingParams(max_new_tokens=8, seed=3)


def _play(engine, prompts, agent: str, n: int = 2, **kw):
    rows = expand_samples(prompts, n)
    return rows, play_agents(engine, rows, SAMPLING, AgentParams(agent, **kw),
                             GenerationStats())


def test_a_two_turn_agents_trajectory_is_its_recorded_ids_in_order(engine, make_prompts):
    rows, played = _play(engine, make_prompts(TEXTS), "openai_agents:two_turns")
    for outcome, calls in played:
        assert "error" not in outcome and len(calls) == 2
        (p1, (s1, l1, _)), (p2, (s2, l2, _)) = [(c.prompt_ids, c.samples[0]) for c in calls]
        # the second request continued the first token for token: its sampled ids as sampled
        assert p2[:len(p1) + len(s1)] == p1 + s1 and len(p2) > len(p1) + len(s1)
    table, stats = agent_rows(rows, played, engine, worker="w", start=time.time())
    assert len(table) == len(rows) and stats.episodes == len(rows) and stats.env_errors == 0
    for row, (outcome, calls) in zip(table.to_pylist(), played):
        (p1, (s1, l1, _)), (p2, (s2, l2, _)) = [(c.prompt_ids, c.samples[0]) for c in calls]
        added = p2[len(p1) + len(s1):]
        assert row["prompt_ids"] == p1
        assert row["response_ids"] == s1 + added + s2
        assert row["loss_mask"] == [1] * len(s1) + [0] * len(added) + [1] * len(s2)
        assert row["logprobs"] == pytest.approx(l1 + [0.0] * len(added) + l2, abs=0)
        assert row["env_reward"] == outcome["reward"] and row["turns"] == 2
    # behaviour logprobs are the model's on exactly these ids: nothing was re-tokenized
    with torch.no_grad():
        logp, _ = response_logprobs(engine.model, table.column("prompt_ids").to_pylist(),
                                    table.column("response_ids").to_pylist(),
                                    engine.tokenizer.pad_token_id, 1.0)
    for i, row in enumerate(table.to_pylist()):
        at = [j for j, m in enumerate(row["loss_mask"]) if m]
        torch.testing.assert_close(logp[i, at].float(), torch.tensor(row["logprobs"])[at],
                                   atol=2e-6, rtol=0)


def test_requests_that_extend_nothing_are_samples_of_their_own(engine, make_prompts):
    table, _ = run_agent_episodes(engine, make_prompts(TEXTS[:2]), 1, SAMPLING,
                                  AgentParams("openai_agents:branches"))
    # per episode: two samples of the first request, and the completions request
    assert len(table) == 3 * 2
    for pid in table.column("prompt_id").unique().to_pylist():
        mine = [r for r in table.to_pylist() if r["prompt_id"] == pid]
        assert sorted(r["sample_idx"] for r in mine) == [0, 1, 2]
        assert {r["env_reward"] for r in mine} == {1.0}  # the episode's reward, shared
        assert all(set(r["loss_mask"]) <= {1} for r in mine)


def test_agent_tokens_take_no_part_in_the_loss(model, engine, make_prompts):
    """Changing the agent-side tokens' behaviour logprobs changes neither the loss nor the
    gradient; changing a sampled token's does."""
    table, _ = run_agent_episodes(engine, make_prompts(TEXTS), 2, SAMPLING,
                                  AgentParams("openai_agents:two_turns"))
    masks = table.column("loss_mask").to_pylist()
    n = len(table)
    trainable = table.append_column("reward", pa.array([0.0] * n, pa.float64())) \
        .append_column("reward_error", pa.array([None] * n, pa.string())) \
        .append_column("advantage", pa.array([1.0, -1.0] * (n // 2), pa.float32()))

    def loss_and_grad(logprobs):
        net = copy.deepcopy(model)
        t = trainable.set_column(trainable.column_names.index("logprobs"), "logprobs",
                                 pa.array(logprobs, pa.list_(pa.float32())))
        out = update_policy(net, torch.optim.SGD(net.parameters(), lr=0.0), t,
                            UpdateParams(), engine.tokenizer.pad_token_id)
        assert out["tokens"] == sum(map(sum, masks))
        return out["loss"], torch.cat([p.grad.flatten() for p in net.parameters()])

    base = table.column("logprobs").to_pylist()
    agent_side = [[lp - 5.0 if m == 0 else lp for lp, m in zip(lps, mask)]
                  for lps, mask in zip(base, masks)]
    sampled = [[lp - 0.5 if m == 1 else lp for lp, m in zip(lps, mask)]
               for lps, mask in zip(base, masks)]
    loss, grad = loss_and_grad(base)
    loss_agent, grad_agent = loss_and_grad(agent_side)
    assert loss_agent == loss and torch.equal(grad_agent, grad)
    assert loss_and_grad(sampled)[0] != loss


def test_a_request_without_the_episodes_key_is_refused(engine):
    server = endpoint()
    server.set_engine(engine, SAMPLING, None)
    token = server.open_episode(7)
    good = openai.OpenAI(base_url=server.base_url, api_key=token, max_retries=0)
    assert good.completions.create(model="m", prompt="Items: fig\nAnswer:", max_tokens=3)
    wrong = openai.OpenAI(base_url=server.base_url, api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="m", prompt="Items: fig\nAnswer:", max_tokens=3)
    bare = httpx.post(f"{server.base_url}/chat/completions",
                      json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert bare.status_code == 401 and set(bare.json()) == {"error"}
    assert len(server.close_episode(token)) == 1  # only the authorised request was served
    with pytest.raises(openai.AuthenticationError):  # a closed episode's key stops working
        good.completions.create(model="m", prompt="Items: fig\nAnswer:", max_tokens=3)


def test_the_model_list_is_served_to_an_open_episodes_key_only():
    """``GET /v1/models`` with no key, a wrong key or a closed episode's key gets 401 and
    nothing else; with an open episode's key, the endpoint's model (the ``openai`` client's
    ``models.list``)."""
    server = endpoint()
    token = server.open_episode(3)
    models = f"{server.base_url}/models"
    for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": token}):
        refused = httpx.get(models, headers=headers)
        assert refused.status_code == 401 and set(refused.json()) == {"error"}, headers
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="not-the-key", max_retries=0) \
            .models.list()
    client = openai.OpenAI(base_url=server.base_url, api_key=token, max_retries=0)
    assert [m.id for m in client.models.list()] == [server.model_name]
    server.close_episode(token)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


@pytest.mark.parametrize(("agent", "said"), [
    ("openai_agents:raises", "RuntimeError: the agent broke"),
    ("openai_agents:hangs", "TimeoutError: the episode ran over 2 s"),
    ("openai_agents:never_calls", "the agent never called the model"),
    ("openai_agents:not_a_number", "not a finite number"),
    ("openai_agents:nosuch", "cannot be loaded"),
])
def test_a_failing_agent_ends_its_episode_as_an_error(engine, make_prompts, agent, said):
    started = time.monotonic()
    table, stats = run_agent_episodes(engine, make_prompts(TEXTS[:2]), 1, SAMPLING,
                                      AgentParams(agent, timeout_s=2.0))
    assert time.monotonic() - started < 20
    assert stats.episodes == 2 and stats.env_errors == 2
    assert set(table.column("finish_reason").to_pylist()) == {"error"}
    assert all(said in e for e in table.column("env_error").to_pylist())
    assert table.column("env_reward").to_pylist() == [0.0] * len(table)


def test_the_time_the_engine_waits_on_agents_is_measured_and_billed_apart(engine,
                                                                        make_prompts):
    """Three episodes at once, each thinking 0.5 s before its request: the engine sampled
    nothing for at least those 0.5 s (its other idle time, the agent process's start, adds to
    it), and never for longer than the shard took."""
    from rlhfless.pipeline.report.bookkeeping import bill_env_wait

    recorded = []
    phases.set_sink(lambda name, t0, t1, args: recorded.append((name, t0, t1)))
    try:
        started, at = time.perf_counter(), time.time()
        _, stats = run_agent_episodes(engine, make_prompts(TEXTS), 1, SAMPLING,
                                      AgentParams("openai_agents:thinks_then_asks"))
        wall, ended = time.perf_counter() - started, time.time()
    finally:
        phases.set_sink(None)
    assert stats.env_errors == 0 and stats.env_seconds >= 3 * 0.5
    assert 0.5 <= stats.env_wait_seconds <= wall
    # the trace's agent_wait spans: in the shard's time, apart, adding up to the wait (the
    # two clocks are read a few microseconds apart at each of the spans' ends)
    waits = sorted((t0, t1) for name, t0, t1 in recorded if name == "agent_wait")
    assert waits and at <= waits[0][0] and waits[-1][1] <= ended
    assert all(a[1] < b[0] for a, b in zip(waits, waits[1:]))
    assert sum(t1 - t0 for t0, t1 in waits) == pytest.approx(stats.env_wait_seconds,
                                                             abs=1e-3)
    bill = bill_env_wait({"env_wait_seconds": stats.env_wait_seconds, "gen_worker_s": 2 * wall},
                         {"gen": 3.0, "train": 1.0})
    assert bill == {"env_wait_worker_s": stats.env_wait_seconds,
                    "env_wait_cost": 3.0 * stats.env_wait_seconds,
                    "env_wait_share": stats.env_wait_seconds / (2 * wall)}
    assert bill_env_wait({"gen_worker_s": 1.0}, {"gen": 3.0}) == {}  # single-turn: nothing
