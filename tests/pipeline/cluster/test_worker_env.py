"""Local pool workers start with the malloc settings of ``deploy.MALLOC_ENV`` (not Dask's
default, which makes torch on CPU about 2x slower: bench/worker_malloc.py). A run's workers,
local or started from its environment variables, never pause at a share of their memory
limit (a paused worker starts no task, and an engine's memory never drains), and a CPU
engine is sized to a share of that limit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dask
import pytest

from rlhfless.pipeline.cluster.deploy import MALLOC_ENV
from rlhfless.pipeline.cluster.pools import Pool, PoolCluster
from rlhfless.pipeline.cluster.supervise import dask_bounds, dask_environment
from rlhfless.pipeline.tasks.engines import ENGINE_RAM_SHARE, engine_ram_bytes
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


def _pause(dask_worker):
    return dask_worker.memory_manager.memory_pause_fraction


def test_a_runs_workers_never_pause_and_size_their_engine_to_their_limit():
    pools = [Pool("gen", 1, 1, {"GEN": 1}, "2GiB")]
    with dask.config.set(dask_bounds(300, 30)), \
            PoolCluster(pools, CostLedger({"gen": 1.0})) as pc:
        (pause,) = pc.client.run(_pause).values()
        ram = pc.client.submit(engine_ram_bytes, pure=False).result()
    assert pause is False
    assert ram == int(2 * 2**30 * ENGINE_RAM_SHARE)


def test_a_worker_started_from_the_runs_environment_never_pauses():
    """A batch job's worker reads the run's Dask config from its environment only."""
    env = dict(os.environ, **dask_environment(dask_bounds(300, 30)))
    code = "import dask, distributed; print(dask.config.get('distributed.worker.memory.pause'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == "False"
