"""The trace-event format's pieces every trace writer shares (the run's, ``trace.py``; the
simulator's, ``sim/trace.py``): tracks named by process, spans in microseconds, a file read
back whether or not it was closed. Imports nothing of the pipeline, so that every part may
write the same format."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

US = 1e6  # the format's clock is microseconds
DRIVER = "driver"


def pid_of(name: str) -> int:
    """A track's process id: the same for a name in every chunk, resumed runs included."""
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def span(name: str, track: str, t0: float, t1: float, cat: str = DRIVER, **args) -> dict:
    """A complete span (``ph: "X"``) on ``track``'s first thread, ``t0``..``t1`` seconds."""
    return {"name": name, "cat": cat, "ph": "X", "pid": pid_of(track), "tid": 0,
            "ts": t0 * US, "dur": (t1 - t0) * US, "args": args}


def driver_span(name: str, t0: float, t1: float, **args) -> dict:
    return span(name, DRIVER, t0, t1, **args)


def meta(name: str) -> dict:
    """The event that names a process track."""
    return {"name": "process_name", "ph": "M", "pid": pid_of(name), "tid": 0,
            "args": {"name": name}}


def read_trace(path: str | Path) -> list[dict]:
    """The events of a trace file, closed or not (a run still writing it)."""
    text = Path(path).read_text().rstrip()
    return json.loads(text if text.endswith("]") else text + "]")


def write_trace(path: str | Path, events: list[dict]) -> None:
    """``events`` as a closed trace file (the format's array form)."""
    Path(path).write_text("[\n" + ",\n".join(json.dumps(e) for e in events) + "\n]\n")


def select(events: list[dict], first: float, last: float) -> list[dict]:
    """The events of iterations ``first`` .. ``last`` and every track's name."""
    return [e for e in events if e["ph"] == "M"
            or first <= (e.get("args", {}).get("iteration") or 0) <= last]
