"""Agent episodes end to end on a real LocalCluster: each generation worker serves its
episodes' requests from its engine, keeping each episode's KV across its requests, the
trajectories train, and an agent that fails ends only its own episodes."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from agent_service import running_service, signed_by_an_authority

from rlhfless.pipeline.config import Config, ConfigError
from rlhfless.pipeline.specs import agent_params
from rlhfless.pipeline.train.loop import train


def test_an_agent_run_trains_on_its_trajectories(tiny_model_dir, tmp_path):
    cfg = Config(model=str(tiny_model_dir), runs_dir=str(tmp_path), name="agent",
                 agent="openai_agents:two_turns", iterations=2, batch_prompts=4, n_samples=2,
                 max_new_tokens=8, heldout_prompts=4, eval_every=2, checkpoint_every=100,
                 gen_workers=2, train_threads=1, agent_timeout_s=30)
    run = train(cfg, progress=False, log=lambda *_: None)
    iterations = [m for m in run.metrics() if m.get("event") == "iteration"]
    assert [m["iteration"] for m in iterations] == [1, 2]
    assert all(m["episodes"] == 8 and m["env_errors"] == 0 for m in iterations)
    # the engines' wait on the agents (their process start at least) is billed apart
    assert all(0 < m["env_wait_worker_s"] <= m["gen_worker_s"]
               and m["env_wait_cost"] > 0 for m in iterations)
    for m in iterations:  # each request ran only what the model had not seen of it
        rows = pq.read_table(run.path / "rollouts"
                             / f"iter-{m['iteration']:05d}.parquet").to_pylist()
        new = sum(len(r["prompt_ids"]) + r["loss_mask"].count(0) for r in rows)
        assert m["prefill_tokens"] <= 1.1 * new
        assert m["prefill_tokens_saved"] >= sum(len(r["prompt_ids"]) for r in rows)
    rows = pq.read_table(run.path / "rollouts" / "iter-00001.parquet").to_pylist()
    assert len(rows) == 8 and {r["turns"] for r in rows} == {2}
    assert all(0 in r["loss_mask"] and r["loss_mask"][0] == 1 for r in rows)
    assert {r["worker"] for r in rows} <= {"gen-0", "gen-1"}


def test_an_agent_service_over_https_trains_the_tool_task(tiny_model_dir, tmp_path):
    """The tool task's agent as a service in another process (``tests/agent_service.py``),
    over HTTPS with a certificate of a private authority (``agent_ca_file``): each episode
    POSTed to it, its requests served by the worker's endpoint."""
    authority, cert, key = signed_by_an_authority(tmp_path)
    with running_service((cert, key)) as url:
        cfg = Config(model=str(tiny_model_dir), runs_dir=str(tmp_path), name="service",
                     agent=f"{url}/tally", agent_ca_file=str(authority),
                     iterations=2, batch_prompts=2, n_samples=2,
                     max_new_tokens=8, heldout_prompts=2, eval_every=100,
                     checkpoint_every=100, gen_workers=1, train_threads=1, agent_timeout_s=30)
        run = train(cfg, progress=False, log=lambda *_: None)
    iterations = [m for m in run.metrics() if m.get("event") == "iteration"]
    assert [(m["iteration"], m["policy_version"]) for m in iterations] == [(1, 0), (2, 1)]
    assert all(m["episodes"] == 4 and m["env_errors"] == 0 and m["env_calls"] >= 4
               and m["tokens"] > 0 for m in iterations)
    rows = pq.read_table(run.path / "rollouts" / "iter-00002.parquet").to_pylist()
    assert len(rows) >= 4 and all(r["policy_version"] == 1 and r["response_ids"]
                                  for r in rows)


def test_agent_config_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="agent = 'nope'"):
        Config(agent="nope")
    with pytest.raises(ConfigError, match="'https://:8000/x': an agent service is an http"):
        Config(agent="https://:8000/x")
    assert agent_params(Config(agent="https://agents.example:8443/run")).agent \
        == "https://agents.example:8443/run"
    with pytest.raises(ConfigError, match="plays its own episodes"):
        Config(agent="openai_agents:two_turns", environment="python")
    with pytest.raises(ConfigError, match="agent_timeout_s"):
        Config(agent="openai_agents:two_turns", agent_timeout_s=0)
    assert Config(task="tally-tool", agent="tally-agent").episode_environment == ""
    worker_bound = Config(agent="openai_agents:two_turns", agent_host="worker")
    assert agent_params(worker_bound).host == "worker"  # the key reaches the workers' tasks
