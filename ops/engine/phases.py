"""What an engine does inside a task, as spans for the run's trace (``pipeline/report/trace.py``).

Engines and generation tasks call ``record(name, t0, t1, **args)`` (wall-clock seconds,
``time.time()``) for each phase of their work: a cold start, a weight fetch, a prefill, a
chunk of decode steps (``DecodeSpans``: one span per ``DECODE_SPAN_S`` at most, with the
tokens sampled in it), the stop at the stop rule (``pause``, zero long), a wait on
environments. Nothing is kept unless a sink is set (``set_sink``): on a Dask worker, the
run's (``pipeline/report/task_phases.py``), which files them under the task running and
ships them when it ends. Imports nothing: every engine may record.
"""

from __future__ import annotations

import time
from collections.abc import Callable

DECODE_SPAN_S = 0.5  # a decode span closes once this long: a task's spans grow with its time

Sink = Callable[[str, float, float, dict], None]
_sink: Sink | None = None


def set_sink(sink: Sink | None) -> None:
    """Where ``record`` sends phases from now on, in this process (``None``: nowhere)."""
    global _sink
    _sink = sink


def record(name: str, t0: float, t1: float, **args) -> None:
    """A phase of the running task from ``t0`` to ``t1`` (seconds), ``args`` its figures."""
    if _sink is not None:
        _sink(name, t0, t1, args)


class DecodeSpans:
    """Decode steps as spans: ``step(tokens)`` after each step; a span of the steps so far is
    recorded once it is ``DECODE_SPAN_S`` long and by ``close``, so the spans' tokens add up
    to every token the steps sampled."""

    def __init__(self) -> None:
        self.t0, self.tokens, self.steps = time.time(), 0, 0

    def step(self, tokens: int) -> None:
        self.tokens += tokens
        self.steps += 1
        if time.time() - self.t0 >= DECODE_SPAN_S:
            self.close()

    def close(self) -> None:
        now = time.time()
        if self.steps:
            record("decode", self.t0, now, tokens=self.tokens, steps=self.steps)
        self.t0, self.tokens, self.steps = now, 0, 0
