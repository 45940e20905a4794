"""Local pool workers start with the malloc settings of ``deploy.MALLOC_ENV`` (not Dask's
default, which makes torch on CPU about 2x slower: bench/worker_malloc.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rlhfless.pipeline.cluster.deploy import MALLOC_ENV
from rlhfless.pipeline.cluster.pools import Pool, PoolCluster
from rlhfless.schedulers.ledger import CostLedger


def _start_environment() -> dict[str, str]:
    """The environment this process was started with (not what it set since)."""
    raw = Path(f"/proc/{os.getpid()}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
def test_local_workers_start_with_our_malloc_thresholds():
    pools = [Pool("gen", 1, 1, {"GEN": 1}, "2GiB")]
    with PoolCluster(pools, CostLedger({"gen": 1.0})) as pc:
        seen = pc.client.run(_start_environment)
    assert len(seen) == 1
    for env in seen.values():
        for key, value in MALLOC_ENV.items():
            assert env.get(key) == value, (key, env.get(key))
