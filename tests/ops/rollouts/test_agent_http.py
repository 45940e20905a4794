"""Agents as services of their own (``agent = "http://..."``, ops/rollouts/agent_http.py): each
episode is POSTed to a real HTTP service in another process (``tests/agent_service.py``), which
plays it with the real ``openai`` client against the worker's endpoint; its trajectories are
the endpoint's records, as an in-process agent's, and a service that fails, answers garbage,
overruns or is not there ends only its own episodes."""

from __future__ import annotations

import socket

import pytest
from agent_service import running_service, self_signed, signed_by_an_authority

from rlhfless.ops.engine.engine_types import SamplingParams
from rlhfless.ops.rollouts.agent import AgentParams, run_agent_episodes

TEXTS = ["Items: fig pear\nAnswer:", "Items: plum\nAnswer:"]
SAMPLING = SamplingParams(max_new_tokens=8, seed=3)


@pytest.fixture(scope="module")
def service():
    with running_service() as url:
        yield url


def _episodes(engine, prompts, agent: str, **kw):
    return run_agent_episodes(engine, prompts, 2, SAMPLING, AgentParams(agent, **kw))


def test_a_services_episodes_are_its_requests_to_the_endpoint(engine, make_prompts, service):
    table, stats = _episodes(engine, make_prompts(TEXTS), f"{service}/two-turns")
    assert stats.episodes == 4 and stats.env_errors == 0 and stats.env_calls == 8
    for row in table.to_pylist():  # two requests of one conversation, the second continued
        assert row["turns"] == 2 and row["env_error"] is None
        mask = row["loss_mask"]
        assert mask[0] == 1 and 0 in mask and mask[-1] == 1
        assert len(mask) == len(row["response_ids"]) == len(row["logprobs"])
        assert row["env_reward"] >= 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("path, said", [
    ("/broken", "the agent service answered 500: the agent broke"),
    ("/nan", "not {\"reward\": <a finite number>}"),
    ("/slow", "TimeoutError: the episode ran over 1 s"),
])
def test_a_failing_service_ends_its_episodes_as_errors(engine, make_prompts, service, path,
                                                       said):
    table, stats = _episodes(engine, make_prompts(TEXTS[:1]), service + path, timeout_s=1.0)
    assert stats.env_errors == stats.episodes == 2
    assert all(said in r["env_error"] and r["finish_reason"] == "error"
               for r in table.to_pylist())


def test_a_service_that_is_not_there_ends_its_episodes_as_errors(engine, make_prompts):
    url = f"http://127.0.0.1:{_free_port()}/episode"
    table, stats = _episodes(engine, make_prompts(TEXTS[:1]), url, timeout_s=5.0)
    assert stats.env_errors == 2
    assert all("ConnectError" in r["env_error"] and url in r["env_error"]
               for r in table.to_pylist())


def test_an_https_service_is_verified_against_the_authorities_the_worker_trusts(
        engine, make_prompts, tmp_path, monkeypatch):
    """A service whose certificate no system authority signed: refused; trusted through
    OpenSSL's ``SSL_CERT_FILE`` in the worker's environment: its episodes run."""
    cert, key = self_signed(tmp_path)
    with running_service((cert, key)) as url:
        table, stats = _episodes(engine, make_prompts(TEXTS[:1]), f"{url}/two-turns")
        assert stats.env_errors == 2
        assert all("CERTIFICATE_VERIFY_FAILED" in r["env_error"] for r in table.to_pylist())
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        table, stats = _episodes(engine, make_prompts(TEXTS[:1]), f"{url}/two-turns")
    assert stats.env_errors == 0 and set(table.column("turns").to_pylist()) == {2}


def test_an_https_service_is_verified_against_the_configured_authority_alone(
        engine, make_prompts, tmp_path):
    """``agent_ca_file``'s PEM (``AgentParams.service_ca``): a service whose certificate that
    authority signed runs its episodes; another authority's certificate, or none configured
    (the system's authorities), is refused."""
    authority, cert, key = signed_by_an_authority(tmp_path)
    other, _, _ = signed_by_an_authority(tmp_path, "other")
    with running_service((cert, key)) as url:
        runs = {ca: _episodes(engine, make_prompts(TEXTS[:1]), f"{url}/two-turns",
                              service_ca=ca and ca.read_text())
                for ca in (authority, other, None)}
    table, stats = runs[authority]
    assert stats.env_errors == 0 and set(table.column("turns").to_pylist()) == {2}
    for refused in (other, None):
        table, stats = runs[refused]
        assert stats.env_errors == 2
        assert all("CERTIFICATE_VERIFY_FAILED" in r["env_error"] for r in table.to_pylist())


@pytest.mark.parametrize("agent, said", [
    ("http://", "an http:// or https:// URL with a host"),
    ("http://host:port/x", "its port is not a number"),
])
def test_a_malformed_service_url_is_refused(agent, said):
    with pytest.raises(ValueError, match=said):
        AgentParams(agent)
