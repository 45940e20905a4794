"""The stall watch's silence: a worker whose heartbeats the scheduler could not read, because
its own event loop was held up (the driver's process runs the scheduler), is not silent for
that time; one that sent none is still removed once its silence, the hold left out, passes
the deadline."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from rlhfless.pipeline.cluster import supervise
from rlhfless.pipeline.cluster.supervise import CHECK_S, StallWatch

FLOOR_S, TTL_S = 6.0, 8.0


@dataclass
class Worker:
    name: str
    last_seen: float
    nanny: str | None = None
    metrics: dict = field(default_factory=dict)
    executing: dict = field(default_factory=dict)
    processing: set = field(default_factory=set)


@dataclass
class Scheduler:
    workers: dict


@pytest.fixture
def watch(monkeypatch):
    clock = {"now": 100.0}
    monkeypatch.setattr(supervise, "time", lambda: clock["now"])
    removed = []

    def remove(address, nanny):
        removed.append((address, clock["now"]))
        return address
    monkeypatch.setattr(supervise.asyncio, "ensure_future", lambda value: value)
    w = StallWatch(factor=2.0, floor_s=FLOOR_S, ttl_s=TTL_S)
    w.remove_silent = remove
    w.scheduler = Scheduler({"a": Worker("gen-1", 100.0)})
    w.seen, w.moved, w.restarting, w.records, w.holds = {}, {}, set(), [], []
    w.last_check = 100.0
    return w, clock, removed


def run_checks(watch: StallWatch, clock: dict, until: float, every: float = CHECK_S) -> None:
    while clock["now"] + every <= until + 1e-9:
        clock["now"] += every
        watch.check()


def test_a_held_loop_is_not_a_silent_worker(watch):
    w, clock, removed = watch
    run_checks(w, clock, 101.0)
    clock["now"] = 110.0  # this loop held 9 s: the worker's heartbeats lay unread
    w.check()
    assert removed == [] and w.holds == [(110.0, 8.0)]
    w.scheduler.workers["a"].last_seen = 110.1  # read now
    run_checks(w, clock, 112.0)
    assert removed == [] and w.holds == []  # older than every worker's last heartbeat


def test_a_worker_silent_past_the_hold_is_removed_at_its_deadline(watch):
    w, clock, removed = watch
    run_checks(w, clock, 101.0)
    clock["now"] = 110.0
    w.check()
    run_checks(w, clock, 125.0)
    # silent since 100, 8 s of it held: past the floor (no decoding task) at 114 and later
    (record,) = w.records
    assert removed == [("a", 115.0)]
    assert record["no_heartbeat"] and record["deadline_s"] == FLOOR_S
    assert record["no_progress_s"] == pytest.approx(7.0)
