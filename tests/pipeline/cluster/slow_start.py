"""A worker preload that takes ``SLOW_START_S`` seconds and stamps when it ran (the test of
pools that start together, test_worker_start.py): one line per worker process, start and end
(``time.time()``), appended to the file named by ``SLOW_START_LOG``."""

from __future__ import annotations

import os
import time

SLOW_START_S = 3.0
started = time.time()
time.sleep(SLOW_START_S)
with open(os.environ["SLOW_START_LOG"], "a") as log:
    log.write(f"{os.getpid()} {started} {time.time()}\n")
