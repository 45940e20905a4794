"""Fixtures of the many-hosts tests: a ``Network`` removed whatever the test did."""

from __future__ import annotations

import pytest
from netns_hosts import Network


@pytest.fixture
def network():
    """A switch and the driver's link; the test adds its hosts. Every process, namespace and
    link is removed at the end, on failure too (``Network.close`` raises if any is left)."""
    net = Network()
    try:
        yield net
    finally:
        net.close()
