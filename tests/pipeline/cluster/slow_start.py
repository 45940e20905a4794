"""A worker preload that ends only once another worker's preload has begun (the test of pools
that start together, test_worker_start.py), so whether two preloads overlapped is read from
what each saw, not from how long they took.

Each worker process appends ``<pid> start`` to the file named by ``SLOW_START_LOG``, waits
until the file holds ``SLOW_START_PEERS`` start lines, then appends ``<pid> end <starts it
saw>``. Preloads run one after the other never see their peer: the first ends after
``SLOW_START_GIVE_UP_S`` with 1, a bound that only ends a wait that would otherwise be
forever."""

from __future__ import annotations

import os
import time

SLOW_START_GIVE_UP_S = 60.0


def _starts(path: str) -> int:
    with open(path) as log:
        return sum(line.split()[1] == "start" for line in log)


path, peers = os.environ["SLOW_START_LOG"], int(os.environ["SLOW_START_PEERS"])
with open(path, "a") as log:
    log.write(f"{os.getpid()} start\n")
give_up = time.monotonic() + SLOW_START_GIVE_UP_S
while (seen := _starts(path)) < peers and time.monotonic() < give_up:
    time.sleep(0.05)
with open(path, "a") as log:
    log.write(f"{os.getpid()} end {seen}\n")
