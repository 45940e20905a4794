"""A simulated run as a trace, in the format of a real run's (``report/trace.py``), so that
a simulated iteration and a run's open side by side in Perfetto.

Tracks: ``driver`` with a span per iteration (its workers, cold starts, moved sequences,
tokens as arguments) and inside it the phases the simulator times (``generate``,
``reward``, ``update``); one track per simulated worker (named as the ledger names it) with
its life: ``cold_start`` from its start until ready, then ``alive`` until it stopped (or the
run's end). Times are the simulator's seconds from the run's start (a run's trace is on the
wall clock: compare durations, not start times).
"""

from __future__ import annotations

from pathlib import Path

from rlhfless.schedulers.sim.simulator import SimResult

from ..report.trace_events import DRIVER, meta, span, write_trace

WORKER = "worker"  # category of a simulated worker's spans


def sim_events(result: SimResult) -> list[dict]:
    """The trace events of ``result`` (see the module docstring)."""
    events = [meta(DRIVER)]
    for it in result.iterations:
        events.append(span("iteration", DRIVER, it.t_start, it.update_end,
                           iteration=it.iteration, workers=it.n_workers,
                           cold_starts=it.cold_starts, moved_sequences=it.moved_sequences,
                           decode_tokens=it.decode_tokens, prefill_tokens=it.prefill_tokens))
        for name, t0, t1 in (("generate", it.gen_start, it.gen_end),
                             ("reward", it.gen_end, it.reward_end),
                             ("update", it.update_start, it.update_end)):
            if t1 > t0:
                events.append(span(name, DRIVER, t0, t1, iteration=it.iteration))
    lives = [r for r in result.ledger.records(until=result.t_end) if r["kind"] == "worker"]
    for name in sorted({r["name"] for r in lives}):
        events.append(meta(name))
    for life in lives:
        end = result.t_end if life["t_end"] is None else life["t_end"]
        ready = end if life["t_ready"] is None else min(life["t_ready"], end)
        if ready > life["t_start"]:
            events.append(span("cold_start", life["name"], life["t_start"], ready, WORKER,
                               pool=life["pool"]))
        if end > ready:
            events.append(span("alive", life["name"], ready, end, WORKER, pool=life["pool"]))
    return events


def write_sim_trace(path: str | Path, result: SimResult) -> Path:
    """``result``'s trace as a closed file at ``path``."""
    write_trace(path, sim_events(result))
    return Path(path)
