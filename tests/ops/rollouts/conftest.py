"""What the agent endpoint's tests share: our engine on the float64 tiny model, and one
started endpoint per test module."""

from __future__ import annotations

import pytest

from rlhfless.ops.engine.backend import HFBackend
from rlhfless.ops.rollouts.agent_server import AgentEndpoint


@pytest.fixture(scope="module")
def engine(model64, tokenizer):
    """Our engine on the float64 model: a recomputation differs from its logprobs only by
    the table's float32 rounding (relative 6e-8 of values below 20: < 2e-6)."""
    return HFBackend.of_model(model64, tokenizer)


@pytest.fixture(scope="module")
def server():
    endpoint = AgentEndpoint()
    endpoint.start()
    yield endpoint
    endpoint.stop()
