"""What a run leaves listening in this process, ended.

The run's scheduler lives in the driver, the test's own process: a run that failed, hung or
ran past pytest's timeout leaves its thread, and its scheduler listening on the network's
address, where a later test of this process finds it (one that checks what its run listens
on failed so). ``end_listeners`` closes such a scheduler, and stops any socket of this
process still listening there; the ``network`` fixture calls it at its end, and at its
start for the networks of this process already closed.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable

import psutil
from distributed import Scheduler

CLOSE_WAIT_S = 20.0  # for a scheduler left running to close


def listeners(on: Callable[[str], bool]) -> list:
    """This process's TCP sockets listening on an address ``on`` accepts."""
    return [c for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and on(c.laddr.ip)]


def end_listeners(on: Callable[[str], bool]) -> list[str]:
    """Close every Dask scheduler of this process listening on an address ``on`` accepts
    (a run left running: it failed, hung, or its test timed out), then stop any socket of
    this process still listening on one; returns what was found listening. Raises if one
    is left."""
    found = [f"{c.laddr.ip}:{c.laddr.port}" for c in listeners(on)]
    if not found:
        return []
    for scheduler in list(Scheduler._instances):
        host = scheduler.address.split("://")[-1].rsplit(":", 1)[0]
        if scheduler.status.name in ("closing", "closed") or not on(host):
            continue
        try:  # on its own loop, which may be the thread of a hung run's cluster
            asyncio.run_coroutine_threadsafe(scheduler.close(reason="left by a test"),
                                             scheduler.loop.asyncio_loop
                                             ).result(CLOSE_WAIT_S)
        except Exception:  # noqa: BLE001 (its socket is stopped below)
            pass
    for conn in listeners(on):  # a scheduler that did not close: its socket stops listening
        with socket.socket(fileno=os.dup(conn.fd)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
    if left := listeners(on):
        raise RuntimeError(f"still listening: {[f'{c.laddr.ip}:{c.laddr.port}' for c in left]}")
    return found
