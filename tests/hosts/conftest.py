"""Fixtures of the many-hosts tests: a ``Network`` removed whatever the test did."""

from __future__ import annotations

import pytest
from leftovers import end_listeners
from netns_hosts import SUBNET, Network

OURS = SUBNET.format("")  # the prefix of every network's addresses


@pytest.fixture
def network():
    """A switch and the driver's link; the test adds its hosts. Every process, namespace and
    link is removed at the end, on failure or pytest's timeout too (``Network.close`` raises
    if any is left), and whatever this process still listens on at the network's address
    (a run that failed or hung: its scheduler) is closed first. A listener an earlier
    network of this process left is closed at the start."""
    end_listeners(lambda ip: ip.startswith(OURS))
    net = Network()
    try:
        yield net
    finally:
        try:
            end_listeners(lambda ip: ip == net.driver_address)
        finally:
            net.close()
