"""The agent endpoint on a worker's own address (``agent_host = "worker"``), served by a real
uvicorn server to the real ``openai`` client: an episode's key is served and nothing else is
(no key, another run's key: 401), and on a TLS cluster it is HTTPS with the worker's
certificate, which agents verify against the run's authority alone. The address is a
non-loopback one of this machine where it has one (``distributed.utils.get_ip``)."""

from __future__ import annotations

import httpx
import openai
import pytest
from distributed import Client, LocalCluster
from distributed.security import Security
from distributed.utils import get_ip

from rlhfless.ops.engine.engine_types import SamplingParams
from rlhfless.ops.rollouts import agent
from rlhfless.ops.rollouts.agent import AgentParams, endpoint, run_agent_episodes
from rlhfless.ops.rollouts.agent_binding import (
    LOOPBACK,
    Binding,
    agent_trust,
    endpoint_binding,
    worker_binding,
)
from rlhfless.ops.rollouts.agent_server import AgentEndpoint
from rlhfless.pipeline.cluster.security import run_credentials

SAMPLING = SamplingParams(max_new_tokens=4, seed=5)
PROMPT = "Items: fig\nAnswer:"
HOST = get_ip()  # this machine's address towards other hosts (127.0.0.1 if it has none)


@pytest.fixture
def serve(engine):
    """``serve(binding)``: a started endpoint of its own (a run's), stopped after the test."""
    started = []

    def start(binding: Binding) -> AgentEndpoint:
        server = AgentEndpoint()
        server.start(binding)
        server.set_engine(engine, SAMPLING, None)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def _client(server: AgentEndpoint, key: str, trust=True) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=10,
                         http_client=openai.DefaultHttpxClient(verify=trust))


def _refused_without_a_key(server: AgentEndpoint, trust=True) -> bool:
    bare = httpx.post(f"{server.base_url}/completions", verify=trust,
                      json={"model": "m", "prompt": PROMPT, "max_tokens": 2})
    return bare.status_code == 401 and set(bare.json()) == {"error"}


def test_on_the_worker_address_an_episodes_key_is_served_and_nothing_else(serve):
    binding = worker_binding(f"tcp://{HOST}:8786", Security())
    assert binding == Binding(HOST)  # a plain-tcp cluster: plain HTTP
    run, other_run = serve(binding), serve(binding)
    assert run.base_url.startswith(f"http://{HOST}:")
    key = run.open_episode(1)
    assert _client(run, key).completions.create(model="m", prompt=PROMPT, max_tokens=2)
    assert _refused_without_a_key(run)
    with pytest.raises(openai.AuthenticationError):  # a key of one run is no key on another
        _client(other_run, key).completions.create(model="m", prompt=PROMPT, max_tokens=2)
    assert len(run.close_episode(key)) == 1  # only the authorised request was served


def test_on_a_tls_cluster_the_worker_address_serves_https_with_the_runs_certificate(
        serve, tmp_path):
    binding = worker_binding(f"tls://{HOST}:8786", run_credentials(tmp_path / "tls"))
    assert binding.host == HOST and binding.scheme == "https"
    run = serve(binding)
    assert run.base_url.startswith(f"https://{HOST}:")
    trust = agent_trust(binding.ca_pem)
    key = run.open_episode(2)
    assert _client(run, key, trust).completions.create(model="m", prompt=PROMPT, max_tokens=2)
    assert _refused_without_a_key(run, trust)
    another_run = worker_binding(f"tls://{HOST}:8786", run_credentials(tmp_path / "other"))
    # trusting the system's authorities, or another run's: no handshake
    for wrong in (True, agent_trust(another_run.ca_pem)):
        with pytest.raises(openai.APIConnectionError):
            _client(run, key, wrong).completions.create(model="m", prompt=PROMPT, max_tokens=2)
    with pytest.raises(httpx.HTTPError):  # plain HTTP is not served there
        httpx.post(run.base_url.replace("https://", "http://") + "/completions", json={})
    assert len(run.close_episode(key)) == 1


def test_agents_of_a_tls_dask_worker_reach_its_endpoint_on_the_worker_address(
        engine, make_prompts, tmp_path, monkeypatch):
    """A real worker of a TLS cluster: its endpoint listens on the worker's host over HTTPS,
    and the agent process it starts verifies it with the run's authority (``ca_pem``). The
    worker runs in this process: its endpoint is stopped after, so that no later test finds
    this process listening beyond loopback."""
    assert endpoint_binding("worker") == Binding()  # outside a worker: loopback
    assert endpoint_binding("loopback").host == LOOPBACK
    security = run_credentials(tmp_path / "tls")
    monkeypatch.setattr(agent, "_ENDPOINT", {})  # this test's endpoints alone
    try:
        with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, host=HOST,
                          protocol="tls://", security=security,
                          dashboard_address=None) as cluster, \
                Client(cluster, security=security) as client:
            played = client.submit(_episodes, engine, make_prompts([PROMPT]))
            stats, base_url = played.result(timeout=60)
    finally:
        for server in agent._ENDPOINT.values():
            server.stop()
    assert stats.episodes == 2 and stats.env_errors == 0
    assert base_url.startswith(f"https://{HOST}:")


def _episodes(engine, prompts):
    """Two agent episodes of ``prompts`` on ``engine``, with agent_host = "worker": their
    statistics and the endpoint's base URL."""
    params = AgentParams("openai_agents:two_turns", host="worker")
    _, stats = run_agent_episodes(engine, prompts, 2, SAMPLING, params)
    return stats, endpoint(params.host).base_url
