"""Progress beats of a worker's long tasks, for the run's stall watch
(pipeline/cluster/supervise.py).

Every decode step (``generate.run_decoding``) calls ``beat()``; the worker sends the count
with each of its heartbeats (the worker metric ``BEATS_METRIC``), so that the scheduler sees
whether a worker's task still moves. A stopped or hung process sends no new count.
"""

from __future__ import annotations

BEATS_METRIC = "rlhfless-beats"
_count = 0


def beat() -> None:
    """One unit of progress (a decode step) of the task running in this process."""
    global _count
    _count += 1


def beats(worker=None) -> int:
    """The beats so far in this process (a Dask worker metric: ``metric(worker)``)."""
    return _count
