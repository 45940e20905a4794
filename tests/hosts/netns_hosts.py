"""Hosts on one machine: Linux network namespaces joined by veth pairs to one bridge.

A ``Network`` is a switch (a namespace holding a bridge) and hosts, each a namespace of its
own with one link, ``eth0``, a veth pair whose other end is a port of the bridge. This
machine's own namespace is the driver's host: it joins the switch by a veth pair too and
gets the subnet's first address, where the run's scheduler listens (``scheduler_host``, as
a user sets it for batch jobs on other nodes). A host reaches the others only through its
link; it has no route to this machine's loopback.

Faults are the ones a network makes: ``cut`` sets a host's bridge port down (its packets
are dropped, its TCP connections neither close nor answer) and ``restore`` sets it up;
``kill`` ends every process of a host at once, as a host that powers off.

``close`` ends every process of every host (``ip netns pids``, so a worker its nanny
spawned goes too), removes every namespace (their veth pairs go with them) and the driver's
link, and checks that nothing is left; the fixtures call it whatever the test did. The
namespaces' names carry the pid of the process that made them, and a new ``Network`` first
removes those of processes that no longer exist (a test process killed before its
``close``). Needs root (``ip netns``, veth, bridge); no ``tc``.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.213.{}"  # a /24 under it per network, one not routed here already
HOST_LINK = "eth0"  # every host's link has the name a user passes as ``interface``


def ip(*args: str) -> str:
    """Run ``ip args``; its stdout. A failure raises with ip's own message."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def remove_orphans() -> None:
    """End the processes and remove the namespaces of networks whose process is gone."""
    for namespace in ip("netns", "list").split():
        made_by = re.fullmatch(r"rlhfless-(\d+)x\d+-.+", namespace)
        if made_by is None or Path(f"/proc/{made_by[1]}").exists():
            continue
        for pid in ip("netns", "pids", namespace).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        ip("netns", "del", namespace)


@dataclass(frozen=True)
class Host:
    name: str
    namespace: str
    address: str
    port: str  # its link's end on the bridge, in the switch namespace


class Network:
    """A switch, the driver's link to it and the hosts added since; see the module."""

    made = 0  # networks this process made: a part of the next one's name

    def __init__(self) -> None:
        remove_orphans()
        Network.made += 1
        self.tag = f"{os.getpid()}x{Network.made}"
        self.switch = f"rlhfless-{self.tag}-switch"
        self.driver_link = f"rlh{self.tag}"
        self.hosts: dict[str, Host] = {}
        self.processes: list[subprocess.Popen] = []
        self.subnet = SUBNET.format(self._free_octet())
        self.driver_address = f"{self.subnet}.1"
        ip("netns", "add", self.switch)
        try:
            ip("-n", self.switch, "link", "add", "bridge", "type", "bridge")
            ip("-n", self.switch, "link", "set", "bridge", "up")
            ip("link", "add", self.driver_link, "type", "veth", "peer", "name", "driver")
            ip("link", "set", "driver", "netns", self.switch)
            ip("-n", self.switch, "link", "set", "driver", "master", "bridge", "up")
            ip("addr", "add", f"{self.driver_address}/24", "dev", self.driver_link)
            ip("link", "set", self.driver_link, "up")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _free_octet() -> int:
        routed = set(re.findall(r"10\.213\.(\d+)\.", ip("-4", "route")))
        return random.choice([n for n in range(1, 255) if str(n) not in routed])

    def add_host(self, name: str) -> Host:
        """A new host ``name`` with the next address, its link up."""
        host = Host(name, f"rlhfless-{self.tag}-{name}",
                    f"{self.subnet}.{10 + len(self.hosts)}", name)
        ip("netns", "add", host.namespace)
        self.hosts[name] = host
        ip("-n", host.namespace, "link", "set", "lo", "up")
        ip("-n", host.namespace, "link", "add", HOST_LINK, "type", "veth", "peer", "name", name)
        ip("-n", host.namespace, "link", "set", name, "netns", self.switch)
        ip("-n", self.switch, "link", "set", name, "master", "bridge", "up")
        ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", HOST_LINK)
        ip("-n", host.namespace, "link", "set", HOST_LINK, "up")
        return host

    def spawn(self, host: Host, argv: list[str], log: Path) -> subprocess.Popen:
        """Start ``argv`` on ``host`` (in its namespace, its own session), output to ``log``."""
        with log.open("ab") as out:
            process = subprocess.Popen(["ip", "netns", "exec", host.namespace, *argv],
                                       stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        self.processes.append(process)
        return process

    def cut_command(self, host: Host) -> list[str]:
        """The command that cuts ``host``'s link: its bridge port set down."""
        return ["ip", "-n", self.switch, "link", "set", host.port, "down"]

    def restore_command(self, host: Host) -> list[str]:
        return ["ip", "-n", self.switch, "link", "set", host.port, "up"]

    def cut(self, host: Host) -> None:
        ip(*self.cut_command(host)[1:])

    def restore(self, host: Host) -> None:
        ip(*self.restore_command(host)[1:])

    def pids(self, host: Host) -> list[int]:
        """Every process running on ``host``."""
        return [int(p) for p in ip("netns", "pids", host.namespace).split()]

    def kill(self, host: Host) -> None:
        """End every process of ``host`` at once (SIGKILL), and wait until none is left."""
        deadline = time.time() + 30
        while pids := self.pids(host):
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._reap()
            if time.time() > deadline:
                raise RuntimeError(f"host {host.name}: processes {pids} outlived SIGKILL")
            time.sleep(0.05)

    def _reap(self) -> None:
        for process in self.processes:
            process.poll()

    def close(self) -> None:
        """End every host's processes, remove every namespace and link; raise if any is
        left (after removing all that could be)."""
        errors = []
        for host in self.hosts.values():
            try:
                self.kill(host)
            except RuntimeError as err:
                errors.append(str(err))
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)
        for namespace in [h.namespace for h in self.hosts.values()] + [self.switch]:
            try:
                ip("netns", "del", namespace)
            except RuntimeError as err:
                errors.append(str(err))
        deadline = time.time() + 10  # the driver's end of its veth goes with its peer
        while self.driver_link in ip("-br", "link") and time.time() < deadline:
            time.sleep(0.05)
        left = [n for n in ip("netns", "list").split() if n.startswith(f"rlhfless-{self.tag}-")]
        if self.driver_link in ip("-br", "link"):
            left.append(self.driver_link)
        if errors or left:
            raise RuntimeError(f"network {self.tag} not removed: {errors + left}")

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
