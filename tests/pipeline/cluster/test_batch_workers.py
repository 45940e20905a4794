"""Where workers do not come back by themselves (batch jobs, hosts of their own), a worker
that left unasked leaves its pool only once Dask's lost-worker timeout has passed without
it: one that its nanny restarted (the stall watch restarts a stalled worker so) stays, and
one whose job ended is dropped after the timeout, not waited for meanwhile."""

from __future__ import annotations

import time
from dataclasses import dataclass

import dask
import pytest
from run_support import wait_for

from rlhfless.pipeline.cluster.deploy import LocalDeployment
from rlhfless.pipeline.cluster.pools import Pool, PoolCluster
from rlhfless.schedulers.ledger import CostLedger

LOST_WORKER_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class BatchJobs(LocalDeployment):
    """Local processes that the run treats as batch jobs: a worker that left is not
    expected back."""

    restarts_workers = False


@pytest.fixture
def pc():
    timeout = {"distributed.deploy.lost-worker-timeout": f"{LOST_WORKER_TIMEOUT_S}s"}
    with dask.config.set(timeout), PoolCluster(
            [Pool("gen", 2, 1, {"GEN": 1}, "2GiB")], CostLedger({"gen": 1.0}),
            deployment=BatchJobs()) as cluster:
        yield cluster


def lifetimes(pc: PoolCluster, name: str) -> list[dict]:
    return [r for r in pc.ledger.records() if r["kind"] == "worker" and r["name"] == name]


def test_a_worker_its_nanny_restarted_stays_in_its_pool(pc):
    before = pc.address_of("gen-0")
    pc.client.restart_workers([before])  # its nanny kills it and starts it again
    after = wait_for(lambda: pc.connected() == {"gen-0", "gen-1"}
                     and pc.address_of("gen-0") != before and pc.address_of("gen-0"),
                     60, "gen-0 back from its restart")
    time.sleep(LOST_WORKER_TIMEOUT_S + 0.5)
    pc.sync_events()
    assert pc.worker_names("gen") == ["gen-0", "gen-1"]
    time.sleep(0.5)  # a retirement would have closed it by now
    assert pc.connected() == {"gen-0", "gen-1"} and pc.address_of("gen-0") == after
    first, second = lifetimes(pc, "gen-0")  # billed up to its departure, and from its return
    assert first["t_end"] is not None and second["t_end"] is None
    assert first["t_end"] <= second["t_start"]


def test_a_worker_whose_job_ended_leaves_its_pool_after_the_timeout(pc):
    pc.cluster.sync(pc.cluster.workers["gen-0"].close)  # the job ended: nanny and worker gone
    wait_for(lambda: pc.connected() == {"gen-1"}, 30, "gen-0 gone")
    pc.sync_events()
    assert pc.worker_names("gen") == ["gen-0", "gen-1"]  # it may yet come back
    started = time.time()
    with pytest.raises(KeyError):
        pc.address_of("gen-0")  # not waited for: it left and is not back
    assert time.time() - started < 1.0
    time.sleep(LOST_WORKER_TIMEOUT_S + 0.5)
    pc.sync_events()
    assert pc.worker_names("gen") == ["gen-1"]
    (gen0,) = lifetimes(pc, "gen-0")
    assert gen0["t_end"] is not None
