"""The hosts harness itself: hosts reach the driver only through their links, a cut link
drops their traffic until restored, and nothing of a network outlives it: not its processes
(a nanny's child too), namespaces or links, whether the test passed, failed, or its process
was killed before it could clean up, nor a scheduler a run left listening on its address."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
from distributed import Scheduler
from distributed.utils import LoopRunner
from leftovers import end_listeners, listeners
from netns_hosts import Network, ip

CONNECT = ("import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), "
           "timeout=float(sys.argv[3])).close()")


def reaches(network: Network, host, port: int, timeout: float = 1.0) -> bool:
    """Whether a process on ``host`` can open a TCP connection to the driver's ``port``."""
    done = subprocess.run(["ip", "netns", "exec", host.namespace, sys.executable, "-c",
                           CONNECT, network.driver_address, str(port), str(timeout)],
                          capture_output=True)
    return done.returncode == 0


def ours(network: Network) -> list[str]:
    names = [n for n in ip("netns", "list").split() if n.startswith(f"rlhfless-{network.tag}-")]
    return names + ([network.driver_link] if network.driver_link in ip("-br", "link") else [])


def test_a_cut_link_drops_a_hosts_traffic_until_restored(network, tmp_path):
    host = network.add_host("gen-0")
    with socket.create_server((network.driver_address, 0)) as server:
        port = server.getsockname()[1]
        assert reaches(network, host, port)
        network.cut(host)
        assert not reaches(network, host, port)
        network.restore(host)
        assert reaches(network, host, port, timeout=5.0)
    links = subprocess.run(["ip", "netns", "exec", host.namespace, "ip", "-br", "addr"],
                           capture_output=True, text=True).stdout.splitlines()
    assert [line.split()[0].split("@")[0] for line in links] == ["lo", "eth0"]
    assert f" {host.address}/24 " in links[1]  # its own address, on its one link


def test_close_removes_every_process_namespace_and_link_after_a_failure(tmp_path):
    network = Network()
    host = network.add_host("gen-0")
    network.spawn(host, ["sh", "-c", "sleep 300 & sleep 300"], tmp_path / "host.log")
    time.sleep(0.2)
    processes = network.pids(host)
    assert len(processes) >= 2  # the shell and its child, as a nanny and its worker
    with pytest.raises(RuntimeError, match="the test failed"):
        with network:
            raise RuntimeError("the test failed")
    assert ours(network) == []
    assert not any(pid_alive(pid) for pid in processes)


def test_a_network_whose_process_was_killed_is_removed_by_the_next(tmp_path):
    maker = subprocess.run([sys.executable, "-c", (
        "import os, sys; sys.path[:0] = sys.argv[1:2]; from netns_hosts import Network; "
        "n = Network(); h = n.add_host('gen-0'); "
        "n.spawn(h, ['sleep', '300'], __import__('pathlib').Path(sys.argv[2])); "
        "print(n.tag, flush=True); os._exit(0)"),
        str(__import__("pathlib").Path(__file__).parent), str(tmp_path / "host.log")],
        capture_output=True, text=True, check=True)
    tag = maker.stdout.strip()
    assert any(n.startswith(f"rlhfless-{tag}-") for n in ip("netns", "list").split())
    with Network():  # its first act: the orphans go
        left = [n for n in ip("netns", "list").split() if n.startswith(f"rlhfless-{tag}-")]
    assert left == []


def test_a_scheduler_left_listening_on_the_network_is_closed(network):
    def on(address: str) -> bool:
        return address == network.driver_address

    async def scheduler() -> Scheduler:
        return await Scheduler(host=network.driver_address,
                               dashboard_address=f"{network.driver_address}:0")

    # a run's scheduler left running (its test failed or hung), and a bare socket
    loop = LoopRunner(asynchronous=False)
    loop.start()
    bare = socket.create_server((network.driver_address, 0))
    try:
        left = loop.run_sync(scheduler)
        assert len(listeners(on)) == 3  # the scheduler, its dashboard, the socket
        assert len(end_listeners(on)) == 3
        assert listeners(on) == [] and left.status.name == "closed"
    finally:
        bare.close()
        loop.stop()


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
