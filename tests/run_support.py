"""A run in a thread of the test, and waiting on what it does: what the fault tests share."""

from __future__ import annotations

import threading
import time

from rlhfless.pipeline.config import Config
from rlhfless.pipeline.train.loop import train


def train_in_thread(cfg: Config) -> tuple[threading.Thread, dict]:
    """``train(cfg)`` started in a daemon thread; its run (``out["run"]``) or what it raised
    (``out["error"]``) lands in the dict returned beside the thread."""
    out: dict = {}

    def target() -> None:
        try:
            out["run"] = train(cfg, progress=False, log=lambda *_: None)
        except BaseException as err:  # handed to the test
            out["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def wait_for(predicate, timeout: float, what: str):
    """``predicate()``'s first true value, asked every 10 ms; an AssertionError naming
    ``what`` after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := predicate():
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
