"""The agent processes of a shard are started before it (their imports done) and the
episodes are spread over them; a process that finished every episode of its shard runs the
next shard's too, one that abandoned an episode over its limit is replaced, a spare of
another agent is replaced, and a spare whose worker is gone (stdin closed without a job)
exits by itself. The endpoint samples the requests of every running episode in one engine
call.
"""

from __future__ import annotations

import time

import pytest

from rlhfless.ops.engine.backend import HFBackend
from rlhfless.ops.engine.engine_types import SamplingParams
from rlhfless.ops.rollouts import agent, agent_process
from rlhfless.ops.rollouts.agent import AgentParams, run_agent_episodes

SAMPLING = SamplingParams(max_new_tokens=4, seed=5)


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    return HFBackend.of_model(model, tokenizer)


def _shard(engine, make_prompts, name: str = "openai_agents:two_turns") -> set[float]:
    """Two episodes of ``name``; their rewards."""
    table, stats = run_agent_episodes(engine, make_prompts(["Items: fig pear\nAnswer:"]), 2,
                                      SAMPLING, AgentParams(name))
    assert stats.episodes == 2 and stats.env_errors == 0
    return set(table.column("env_reward").to_pylist())


def test_the_next_shard_runs_in_the_processes_of_the_last_one(engine, make_prompts):
    name = "openai_agents:reports_its_process"
    _shard(engine, make_prompts, name)
    spares = list(agent_process.SPARES)
    assert len(spares) == 2  # AgentParams.processes
    assert all(s.agent == name and s.proc.poll() is None for s in spares)
    # its two episodes ran one in each spare
    assert _shard(engine, make_prompts, name) == {float(s.proc.pid) for s in spares}
    after = agent_process.SPARES  # which finished their jobs and wait for the next one
    assert sorted(id(s) for s in after) == sorted(id(s) for s in spares)
    assert all(s.proc.poll() is None for s in after)


def test_a_process_that_abandoned_an_episode_is_replaced(engine, make_prompts):
    agent_process.close_spares()
    ran = agent_process.AgentProcess.start("openai_agents:hangs")  # the one the shard takes
    agent_process.SPARES.append(ran)
    started = time.perf_counter()
    table, stats = run_agent_episodes(engine, make_prompts(["Items: fig pear\nAnswer:"]), 1,
                                      SAMPLING, AgentParams("openai_agents:hangs",
                                                            timeout_s=1.0, processes=1))
    assert time.perf_counter() - started < 20.0  # not the agent's 30 s
    assert stats.env_errors == 1 and "TimeoutError" in table.column("env_error")[0].as_py()
    assert ran.proc.poll() is not None  # its thread still ran: the process ended
    (spare,) = agent_process.SPARES
    assert spare is not ran and spare.proc.poll() is None


def test_one_process_runs_every_episode_of_its_shard(engine, make_prompts):
    name = "openai_agents:reports_its_process"
    table, _ = run_agent_episodes(engine, make_prompts(["Items: fig pear\nAnswer:"]), 3,
                                  SAMPLING, AgentParams(name, processes=1))
    assert len(set(table.column("env_reward").to_pylist())) == 1  # one process id
    assert len(agent_process.SPARES) == 1  # and it waits for the next shard


def test_a_spare_of_another_agent_is_replaced(engine, make_prompts):
    _shard(engine, make_prompts)
    spares = list(agent_process.SPARES)
    _shard(engine, make_prompts, "openai_agents:branches")
    assert all(s.proc.poll() is not None for s in spares)
    assert {s.agent for s in agent_process.SPARES} == {"openai_agents:branches"}


def test_a_spare_exits_when_its_stdin_closes_without_a_job():
    spare = agent_process.AgentProcess.start("openai_agents:two_turns")
    spare.proc.stdin.close()
    assert spare.proc.wait(timeout=60) == 0
    spare.close()


def test_the_endpoint_batches_every_running_episodes_request_and_no_more(engine, make_prompts,
                                                                        monkeypatch):
    """With a window far longer than the run, each engine call still starts as soon as every
    running episode has sent its request: all 8 first requests in one call, then the 4 odd
    samples' second ones, without waiting for the 4 episodes that ended."""
    server = agent.endpoint()
    monkeypatch.setattr(server, "batch_window_s", 30.0)
    batches, decode = [], engine.decode_turns

    def counted(turns, *args, **kwargs):
        batches.append(len(turns))
        return decode(turns, *args, **kwargs)

    monkeypatch.setattr(engine, "decode_turns", counted)
    prompts = make_prompts(["Items: fig pear\nAnswer:", "Items: plum\nAnswer:",
                            "Count: kiwi lime\nAnswer:", "Items: rice\nAnswer:"])
    started = time.perf_counter()
    _, stats = run_agent_episodes(engine, prompts, 2, SAMPLING,
                                  AgentParams("openai_agents:asks_once_or_twice",
                                              concurrency=8))
    assert stats.env_errors == 0 and batches == [8, 4]
    assert time.perf_counter() - started < 30.0  # no call waited for its window
