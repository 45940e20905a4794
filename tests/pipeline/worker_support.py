"""Killing a generation worker of a test's own cluster (shared by the KV move tests)."""

from __future__ import annotations

import os
import time


def kill_worker(pc, addr: str) -> None:
    """SIGKILL the worker process at ``addr`` (started by the test's ``PoolCluster`` ``pc``)
    and wait until the scheduler has removed it (its nanny then restarts it)."""
    c = pc.client
    os.kill(c.run(os.getpid, workers=[addr])[addr], 9)
    deadline = time.time() + 60
    while addr in c.scheduler_info(n_workers=-1)["workers"] and time.time() < deadline:
        time.sleep(0.1)
    assert addr not in c.scheduler_info(n_workers=-1)["workers"]
