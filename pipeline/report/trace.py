"""The run's trace, ``runs/<name>/trace.json``, in the Chrome trace-event format (Perfetto,
``chrome://tracing``).

Tracks: one process per worker (named by the worker, e.g. ``gen-0``) with a thread track per
Dask thread it ran tasks on, and one process ``driver`` for the training loop. Spans:

- per task, its compute span (``ph: "X"``) on the thread that ran it (moved where Dask's
  clock-offset correction would overlap it with the thread's previous one: ``task_events``),
  named by the task's stage, with ``key``, ``iteration``, ``shard``, ``tag`` (``eval`` for
  the held-out graph), ``policy_version`` (the version the iteration's rows were generated
  by; the trainer's for update and publish), ``bytes`` (its result's size) as arguments;
- inside it, what the engine did (``ops/engine/phases.py``, shipped by
  ``task_phases.py``): spans (category ``phase``) of its cold start, weight fetch, prefills
  (``tokens``, ``reused_tokens``, ``requests``), decode chunks (``tokens``, ``steps``), the
  stop at the stop rule (``pause``: zero long, with the rows left ``live`` and ``by``
  ``tau`` or ``interrupted``: the pause flag or a deadline) and its waits on environments
  (``env_wait``), with the task's ``key``, ``iteration``, ``shard`` and ``tag``; each placed
  by its offset from the task's start, and kept inside the task's span;
- the task's other phases (input transfers, disk reads) as async spans (``ph: "b"/"e"``,
  category ``transfer``) of its worker, beside the thread: a transfer overlaps the compute
  of the task before it, so it has no place on the thread's track;
- per iteration on the driver, a span ``iteration`` with its policy version, bound,
  samples and tokens, and inside it the loop's phases (``step``, ``account``,
  ``evaluate``, ``after_iteration``: the checkpoint when one is due).

The file is written as the run goes, one chunk per iteration, in the format's array form:
the closing ``]`` is written when the run ends (Perfetto opens a file without it, e.g. of a
run still going; ``read_trace`` reads both). Its size is bounded per iteration: a chunk
holds at most ``MAX_TASKS`` tasks, an even sample of them by start time where more ran, and
the phases of at most ``MAX_PHASES`` (those of an even sample of the kept tasks, each
task's all or none), and says so (a ``sampled`` instant event with how many tasks ran and
how many were kept, and how many phases were).
``rlhfless trace`` writes a part of it (``--iterations a:b``) as a file of its own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlhfless.schedulers.dask.plugin import task_records

from ..task_keys import parse_key
from . import task_phases
from .trace_events import DRIVER, US, driver_span, meta, pid_of, read_trace, select

MAX_TASKS = 5000  # per iteration's chunk; a tiny run's iteration runs tens
MAX_PHASES = 50_000  # per chunk: phases of the tasks kept
PHASE_ARGS = ("key", "iteration", "shard", "tag")  # the task's, on each of its phases
TRAINER_STAGES = ("update", "publish")  # tasks at the trainer's version, not the rows'


class TaskStream:
    """The scheduler's task records, each given once: ``take`` returns those since the last,
    each with its ``phases`` where its worker shipped any (``task_phases.py``). Made before
    the tasks it is to see: it installs what records them."""

    def __init__(self, client) -> None:
        self.client, self.index = client, 0
        client.run_on_scheduler(task_records, since=0)  # Dask's task stream, from now
        task_phases.install(client)

    def take(self) -> list[dict]:
        records, self.index = self.client.run_on_scheduler(task_records, since=self.index)
        phases = self.client.run_on_scheduler(task_phases.drain)
        return [r | phases.get(str(r["key"]), {}) for r in records]


def compute_start(task: dict) -> float:
    starts = [ss["start"] for ss in task["startstops"] if ss["action"] == "compute"]
    return min(starts, default=task["startstops"][0]["start"])


def task_events(tasks: list[dict], versions: dict[int, dict],
                ends: dict[tuple[int, int], float] | None = None) -> list[dict]:
    """The trace events of task-stream records (module docstring); ``versions``:
    iteration -> its metrics record (``generated_by``, ``policy_version``); ``ends``: where
    each thread track's last span ends (kept across chunks, updated here).

    Dask shifts a task's times by its estimate of the worker's clock offset, which moves
    between tasks; where that puts a task's compute before the end of the one its thread
    ran before, the span starts at that end, its duration unchanged, and says by how much
    it moved (``clock_shift_us``)."""
    events, ends = [], {} if ends is None else ends
    for n, task in enumerate(sorted(tasks, key=compute_start)):
        parsed = parse_key(task["key"])
        stage = parsed.stage if parsed else str(task["key"]).split("-")[0]
        args = {"key": str(task["key"]), "bytes": task.get("nbytes"),
                "status": task.get("status")}
        if parsed is not None:
            record = versions.get(parsed.iteration, {}) if not parsed.tag else {}
            field = "policy_version" if stage in TRAINER_STAGES else "generated_by"
            args |= {"iteration": parsed.iteration, "shard": parsed.shard, "tag": parsed.tag,
                     "policy_version": record.get(field)}
        # a thread's ident is a 64-bit address: its low 31 bits, in the range viewers read
        pid, tid = pid_of(task["worker_name"]), int(task.get("thread") or 0) & 0x7FFFFFFF
        for ss in task["startstops"]:
            if ss["action"] == "compute":
                ts, dur = ss["start"] * US, (ss["stop"] - ss["start"]) * US
                shift = max(0.0, ends.get((pid, tid), ts) - ts)
                ends[(pid, tid)] = ts + shift + dur
                events.append({"name": stage, "cat": "task", "ph": "X", "pid": pid,
                               "tid": tid, "ts": ts + shift, "dur": dur,
                               "args": args | {"clock_shift_us": shift} if shift else args})
                events += phase_spans(task, events[-1])
            else:
                span = {"name": ss["action"], "cat": "transfer", "pid": pid,
                        "id": f"{args['key']}/{n}/{ss['action']}", "args": args}
                events += [{**span, "ph": "b", "ts": ss["start"] * US},
                           {**span, "ph": "e", "ts": ss["stop"] * US}]
    return events


def phase_spans(task: dict, span: dict) -> list[dict]:
    """The spans of ``task``'s phases (``[name, offset s, seconds, args]``) inside its
    compute ``span``: at their offsets from its start, cut to its end."""
    inside = {k: span["args"][k] for k in PHASE_ARGS if k in span["args"]}
    out = []
    for name, offset, seconds, args in task.get("phases", ()):
        t0 = min(max(offset * US, 0.0), span["dur"])
        t1 = min(max((offset + seconds) * US, t0), span["dur"])
        out.append({"name": name, "cat": "phase", "ph": "X", "pid": span["pid"],
                    "tid": span["tid"], "ts": span["ts"] + t0, "dur": t1 - t0,
                    "args": inside | args})
    if task.get("dropped"):
        span["args"] = span["args"] | {"phases_dropped": task["dropped"]}
    return out


def sampled(tasks: list[dict], limit: int = MAX_TASKS) -> list[dict]:
    """At most ``limit`` of ``tasks``, evenly spread over their start order."""
    if len(tasks) <= limit:
        return tasks
    order = sorted(tasks, key=lambda t: t["startstops"][0]["start"])
    return [order[i * len(order) // limit] for i in range(limit)]


def thinned(tasks: list[dict], limit: int = MAX_PHASES) -> list[dict]:
    """``tasks`` with the phases of every k-th only (k: what brings them to ``limit``), and
    of none past ``limit``; a task keeps all its phases or none."""
    total = sum(len(t.get("phases", ())) for t in tasks)
    if total <= limit:
        return tasks
    every, out, kept = -(-total // limit), [], 0
    for n, task in enumerate(tasks):
        count = len(task.get("phases", ()))
        if n % every or kept + count > limit:
            task = {k: v for k, v in task.items() if k not in ("phases", "dropped")}
        else:
            kept += count
        out.append(task)
    return out


class RunTrace:
    """Writes ``trace.json`` chunk by chunk (module docstring); ``close`` ends the array."""

    def __init__(self, path: Path, resume: bool = False) -> None:
        self.path = Path(path)
        self.phases: list[dict] = []  # the driver's, not yet written
        self.named: set[str] = set()
        self.ends: dict[tuple[int, int], float] = {}  # thread track -> its last span's end
        if resume and self.path.exists():
            text = self.path.read_text().rstrip()
            self.path.write_text(text.removesuffix("]").rstrip())
        else:
            self.path.write_text("[")
        self.empty = self.path.read_text() == "["

    @contextmanager
    def phase(self, name: str, iteration: int, **args) -> Iterator[None]:
        """A span of the driver's track around the block."""
        t0 = time.time()
        try:
            yield
        finally:
            self.phases.append(driver_span(name, t0, time.time(), iteration=iteration, **args))

    def write(self, tasks: list[dict], versions: dict[int, dict], iteration: int | None = None,
              t0: float | None = None, record: dict | None = None) -> None:
        """A chunk: ``tasks`` (sampled to ``MAX_TASKS``), the driver's phases so far, and,
        given ``t0`` and its ``record``, the span of ``iteration`` from ``t0`` to now."""
        kept = thinned(sampled(tasks))
        events = task_events(kept, versions, self.ends) + self.phases
        phases = [sum(len(t.get("phases", ())) for t in ts) for ts in (tasks, kept)]
        if len(kept) < len(tasks) or phases[1] < phases[0]:
            events.append({"name": "sampled", "ph": "i", "s": "g", "pid": pid_of(DRIVER),
                           "tid": 0, "ts": time.time() * US,
                           "args": {"iteration": iteration, "tasks": len(tasks),
                                    "kept": len(kept), "phases": phases[0],
                                    "phases_kept": phases[1]}})
        if t0 is not None and record is not None:
            events.append(driver_span("iteration", t0, time.time(), **iteration_args(record)))
        names = {DRIVER} | {t["worker_name"] for t in kept}
        events = [meta(name) for name in sorted(names - self.named)] + events
        self.named |= names
        self.phases = []
        with self.path.open("a") as f:
            for event in events:
                f.write(("\n" if self.empty else ",\n") + json.dumps(event))
                self.empty = False

    def close(self) -> None:
        with self.path.open("a") as f:
            f.write("\n]\n")


def iteration_args(record: dict) -> dict:
    keys = ("iteration", "policy_version", "generated_by", "bound", "samples",
            "tokens", "prefill_tokens", "decode_tokens", "gen_busy_share", "train_busy_share")
    return {k: record[k] for k in keys if k in record}


def write_part(run: Path, first: int, last: float, output: Path | None) -> str:
    """``rlhfless trace``: iterations ``first`` .. ``last`` of ``run``'s trace as a closed
    file (default ``RUN/trace-<first>-<last>.json``); returns the line to say."""
    source = Path(run) / "trace.json"
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no trace; give a run directory, runs/<name>, of "
                                "a run that recorded one")
    events = select(read_trace(source), first, last)
    span = f"{first}-{last if last != float('inf') else 'end'}"
    output = Path(output) if output else Path(run) / f"trace-{span}.json"
    output.write_text(json.dumps(events))
    spans = sum(e["ph"] == "X" for e in events)
    tracks = len({(e["pid"], e.get("tid")) for e in events if e["ph"] == "X"})
    return (f"{output}: {spans} spans on {tracks} tracks, iterations {span}; open it in "
            "Perfetto (ui.perfetto.dev) or chrome://tracing")
