"""The run's ``trace.json`` and its pools' busy / waiting / idle seconds, read from the real
finished elastic run: the trace is valid trace-event JSON; every task the run's graph ran
has a span on the worker that ran it (the generate tasks on the workers the rollouts name,
each iteration's update on the trainer, and their seconds those of the stage timings the
runner took through ``client.get_task_stream``); the spans of a track nest and never
overlap; each generation task holds its engine's phases (prefill, decode chunks), inside
its span, and the decode spans' tokens of an iteration add up to its ``decode_tokens``;
each pool's busy, waiting and idle seconds add up to its worker-seconds in the
ledger, and its busy seconds are those of the trace's spans inside the iteration;
``rlhfless trace`` writes the iterations asked; and, on records made by hand,
``pool_time``'s arithmetic."""

from __future__ import annotations

import json
from collections import defaultdict

import pyarrow.parquet as pq
import pytest

from rlhfless.pipeline.cli import main
from rlhfless.pipeline.report.pool_time import bound, pool_time
from rlhfless.pipeline.report.trace import (
    MAX_TASKS,
    RunTrace,
    read_trace,
    task_events,
    thinned,
)

# Timestamps are unix microseconds (~1.8e15): one float ulp there is 0.25 µs, and ts + dur
# adds at most a few ulps, so 1 µs tells a real overlap from rounding.
ULP_SLACK_US = 1.0
PHASES = {"X": ("name", "ts", "dur", "pid", "tid"), "b": ("name", "ts", "pid", "id", "cat"),
          "e": ("name", "ts", "pid", "id", "cat"), "M": ("name", "pid", "args"),
          "i": ("name", "ts", "pid")}


@pytest.fixture(scope="module")
def trace(finished_run):
    """The events of the finished run's trace, each checked against the format's fields."""
    events = json.loads((finished_run / "trace.json").read_text())  # closed: plain JSON
    assert isinstance(events, list) and events
    for e in events:
        assert set(PHASES[e["ph"]]) <= set(e), e
        assert e.get("dur", 0) >= 0, e
    return events


@pytest.fixture(scope="module")
def run_records(finished_run):
    metrics = [json.loads(line) for line in (finished_run / "metrics.jsonl").open()]
    ledger = json.loads((finished_run / "ledger.json").read_text())
    return [m for m in metrics if m.get("event") == "iteration"], ledger


def track_names(events: list[dict]) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}


def test_every_task_of_the_graph_has_a_span_on_its_worker(finished_run, trace, run_records):
    names = track_names(trace)
    spans = [e for e in trace if e["ph"] == "X" and e.get("cat") == "task"]
    iterations, _ = run_records
    assert [m["iteration"] for m in iterations] == [1, 2]
    for m in iterations:
        i = m["iteration"]
        mine = [e for e in spans if e["args"].get("iteration") == i and not e["args"]["tag"]]
        rollouts = pq.read_table(finished_run / "rollouts" / f"iter-{i:05d}.parquet")
        generated_on = {names[e["pid"]] for e in mine if e["name"] == "generate"}
        assert set(rollouts.column("worker").to_pylist()) <= generated_on
        assert all(w.startswith("gen-") for w in generated_on)
        updates = [e for e in mine if e["name"] == "update"]
        assert len(updates) == 1 and names[updates[0]["pid"]].startswith("train-")
        assert updates[0]["args"]["policy_version"] == m["policy_version"]
        by_stage = defaultdict(float)
        for e in mine:
            by_stage[e["name"]] += e["dur"] / 1e6
        stages = {k[: -len("_busy_s")] for k in m if k.endswith("_busy_s")} - {"gen", "train"}
        assert stages and stages == set(by_stage)
        for stage in stages:  # the same tasks, from the runner's own task stream
            assert by_stage[stage] == pytest.approx(m[f"{stage}_busy_s"], rel=1e-9, abs=1e-6)
    driver = [e for e in trace if e["ph"] == "X" and e["cat"] == "driver"]
    assert [e["args"]["iteration"] for e in driver if e["name"] == "iteration"] == [1, 2]
    assert {e["args"]["bound"] for e in driver if e["name"] == "iteration"} <= {
        "generation-bound", "update-bound", "agent-bound"}


def test_spans_of_a_track_nest_and_never_overlap(trace):
    tracks = defaultdict(list)
    for e in trace:
        if e["ph"] == "X":
            tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    assert len({pid for pid, _ in tracks}) >= 3  # driver, a generation worker, the trainer
    for spans in tracks.values():
        open_ends: list[float] = []  # ends of the spans that hold the next one
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ends and start >= open_ends[-1] - ULP_SLACK_US:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1] + ULP_SLACK_US, (start, end)
            open_ends.append(end)


def test_engine_phases_sit_in_their_task_and_add_up_to_the_runs_tokens(trace, run_records):
    tasks = {e["args"]["key"]: e for e in trace if e["ph"] == "X" and e["cat"] == "task"}
    phases = [e for e in trace if e["ph"] == "X" and e["cat"] == "phase"]
    for e in phases:  # on its task's thread, inside its span
        task = tasks[e["args"]["key"]]
        assert (e["pid"], e["tid"]) == (task["pid"], task["tid"])
        assert task["ts"] <= e["ts"] and e["ts"] + e["dur"] <= task["ts"] + task["dur"], e
    decoded = {key for key, t in tasks.items() if t["name"] in ("generate", "resume")}
    assert decoded and decoded <= {e["args"]["key"] for e in phases if e["name"] == "decode"}
    fetched = [e["args"] for e in phases if e["name"] == "weight_fetch"]
    assert fetched and {e["name"] for e in phases} >= {"cold_start", "prefill", "decode"}
    for args in fetched:  # the version its task generates from (held-out: the iteration's)
        task = tasks[args["key"]]["args"]
        assert args["version"] == (task["iteration"] if task["tag"] else task["policy_version"])
    iterations, _ = run_records
    for m in iterations:
        mine = [e for e in phases
                if e["args"]["iteration"] == m["iteration"] and not e["args"]["tag"]]
        for name in ("decode", "prefill"):
            tokens = sum(e["args"]["tokens"] for e in mine if e["name"] == name)
            assert tokens == m[f"{name}_tokens"] > 0, name


def test_busy_waiting_idle_add_up_to_the_ledger(trace, run_records):
    iterations, ledger = run_records
    names = track_names(trace)
    lives = [r for r in ledger["records"] if r["kind"] == "worker"]
    windows = {r["iteration"]: (r["t_start"], r["t_end"], r) for r in ledger["by_iteration"]}
    compute = defaultdict(list)
    for e in trace:
        if e["ph"] == "X" and e.get("cat") == "task":
            start = e["ts"] - e["args"].get("clock_shift_us", 0.0)  # as Dask measured it
            compute[names[e["pid"]]].append((start / 1e6, (start + e["dur"]) / 1e6))
    for m in iterations:
        t0, t1, billed = windows[m["iteration"]]
        assert m["bound"] in ("generation-bound", "update-bound", "agent-bound")
        for pool in ("gen", "train"):
            parts = [m[f"{pool}_{p}_s"] for p in ("busy", "waiting", "idle")]
            assert min(parts) >= 0
            assert sum(parts) == pytest.approx(billed[f"{pool}_worker_s"], rel=0.01)
            shares = [m[f"{pool}_{p}_share"] for p in ("busy", "waiting", "idle")]
            assert sum(shares) == pytest.approx(1.0, rel=0.01)
            busy = 0.0  # the trace's compute spans in the window, while billed, per worker
            for life in (x for x in lives if x["pool"] == pool):
                lo, hi = max(t0, life["t_start"]), min(t1, life["t_end"])
                cut = sorted((max(a, lo), min(b, hi)) for a, b in compute[life["name"]]
                             if min(b, hi) > max(a, lo))
                reach = lo
                for a, b in cut:  # union: threads of one worker may overlap
                    busy += max(0.0, b - max(a, reach))
                    reach = max(reach, b)
            assert busy > 0
            assert m[f"{pool}_busy_s"] + m.get(f"{pool}_agent_wait_s", 0.0) == pytest.approx(
                busy, rel=0.01)


def test_pool_time_arithmetic():
    """One generation worker billed 10 s: two threads compute 1–3 and 2–4 (3 s of union), an
    input transfer 0–1.5 (1 s outside compute), 1 s waiting on an agent; a trainer that
    computes 5–6 and is billed from 2 on."""
    lives = [{"kind": "worker", "name": "gen-0", "pool": "gen", "t_start": -5.0, "t_end": None},
             {"kind": "worker", "name": "train-0", "pool": "train", "t_start": 2.0,
              "t_end": 12.0},
             {"kind": "stage", "name": None, "pool": None, "t_start": 0.0, "t_end": 10.0}]
    tasks = [{"worker_name": "gen-0", "startstops": [
                 {"action": "transfer", "start": 0.0, "stop": 1.5},
                 {"action": "compute", "start": 1.0, "stop": 3.0}]},
             {"worker_name": "gen-0", "startstops": [
                 {"action": "compute", "start": 2.0, "stop": 4.0}]},
             {"worker_name": "train-0", "startstops": [
                 {"action": "compute", "start": 5.0, "stop": 6.0}]}]
    out = pool_time(tasks, lives, 0.0, 10.0, env_wait_s=1.0)
    assert (out["gen_busy_s"], out["gen_waiting_s"], out["gen_idle_s"]) == (2.0, 2.0, 6.0)
    assert (out["train_busy_s"], out["train_waiting_s"], out["train_idle_s"]) == (1.0, 0, 7.0)
    assert out["gen_busy_share"] == 0.2 and out["train_idle_share"] == 0.875
    assert out["gen_active_s"] == 3.0 and out["bound"] == "generation-bound"
    assert pool_time(tasks, lives, 0.0, 10.0, env_wait_s=2.5)["bound"] == "agent-bound"
    assert bound({"gen_active_s": 1.0, "train_active_s": 2.0}) == "update-bound"
    assert bound({"gen_active_s": 0.0, "train_active_s": 0.0}) is None


def test_cli_trace_writes_the_iterations_asked(finished_run, trace, tmp_path):
    part = tmp_path / "part.json"
    assert main(["trace", str(finished_run), "--iterations", "2:2", "-o", str(part)]) == 0
    events = json.loads(part.read_text())
    assert {e["args"]["iteration"] for e in events if e["ph"] != "M"} == {2}
    assert sorted(map(json.dumps, events)) == sorted(  # every event of iteration 2, no other
        json.dumps(e) for e in trace if e["ph"] == "M" or e["args"].get("iteration") == 2)
    with pytest.raises(SystemExit) as bad:
        main(["trace", str(finished_run), "--iterations", "two"])
    assert bad.value.code == 2
    unclosed = tmp_path / "trace.json"  # as a run still writing it leaves it
    unclosed.write_text((finished_run / "trace.json").read_text().rstrip().removesuffix("]"))
    assert read_trace(unclosed) == trace


def test_a_resumed_trace_goes_on_and_a_chunk_keeps_at_most_max_tasks(tmp_path):
    """Chunks of made-up task records: one over the bound is an even sample of it and says
    so; a trace reopened to resume keeps what it had and is one JSON array when closed."""
    def tasks(n: int, iteration: int) -> list[dict]:
        return [{"key": f"generate-{iteration}-{k}", "worker_name": "gen-0", "thread": 7,
                 "nbytes": 10, "status": "OK",
                 "startstops": [{"action": "compute", "start": k, "stop": k + 0.5}]}
                for k in range(n)]

    path = tmp_path / "trace.json"
    first = RunTrace(path)
    first.write(tasks(MAX_TASKS + 3, 1), {1: {"generated_by": 0}})
    first.close()
    again = RunTrace(path, resume=True)
    again.write(tasks(2, 2), {2: {"generated_by": 1}})
    again.close()
    events = json.loads(path.read_text())
    spans = [e for e in events if e["ph"] == "X"]
    per_iteration = [sum(e["args"]["iteration"] == i for e in spans) for i in (1, 2)]
    assert per_iteration == [MAX_TASKS, 2]
    starts = [e["ts"] / 1e6 for e in spans if e["args"]["iteration"] == 1]
    assert starts[0] == 0 and starts[-1] >= MAX_TASKS  # spread over the chunk, not its head
    assert [e["args"] for e in events if e["name"] == "sampled"] == [
        {"iteration": None, "tasks": MAX_TASKS + 3, "kept": MAX_TASKS, "phases": 0,
         "phases_kept": 0}]
    assert {e["args"]["policy_version"] for e in spans} == {0, 1}


def test_a_task_the_clock_correction_overlaps_starts_where_its_threads_last_ended():
    """Dask's clock-offset estimate moved between two tasks of one thread: the second seems
    to start 0.25 s before the first stopped; its span starts at that stop, as long."""
    tasks = [{"key": f"reward-1-{k}", "worker_name": "gen-0", "thread": 7,
              "startstops": [{"action": "compute", "start": a, "stop": b}]}
             for k, (a, b) in enumerate([(0.0, 1.0), (0.75, 1.5), (2.0, 2.5)])]
    spans = task_events(tasks, {})
    assert [(e["ts"], e["dur"]) for e in spans] == [(0.0, 1e6), (1e6, 0.75e6), (2e6, 0.5e6)]
    assert [e["args"].get("clock_shift_us") for e in spans] == [None, 0.25e6, None]


def test_a_tasks_phases_sit_inside_its_span_and_a_chunk_keeps_at_most_a_bound_of_them():
    """Phases at their offsets from the task's start, cut to its span (the worker's clock
    starts the task a little before Dask's does); past the bound, whole tasks' phases go."""
    task = {"key": "generate-1-0", "worker_name": "gen-0", "thread": 7,
            "startstops": [{"action": "compute", "start": 10.0, "stop": 11.0}],
            "phases": [["prefill", -0.25, 0.5, {"tokens": 5}],
                       ["decode", 0.25, 0.5, {"tokens": 9}],
                       ["decode", 0.75, 0.5, {"tokens": 3}]]}
    span, *phases = task_events([task], {})
    assert [(e["name"], e["ts"], e["dur"]) for e in phases] == [
        ("prefill", 10e6, 0.25e6), ("decode", 10.25e6, 0.5e6), ("decode", 10.75e6, 0.25e6)]
    assert all((e["pid"], e["tid"], e["args"]["key"], e["args"]["iteration"]) ==
               (span["pid"], span["tid"], "generate-1-0", 1) for e in phases)
    assert [e["args"]["tokens"] for e in phases] == [5, 9, 3]
    many = [dict(task, key=f"generate-1-{k}") for k in range(10)]
    kept = [len(t.get("phases", ())) for t in thinned(many, limit=12)]
    assert kept == [3, 0, 0, 3, 0, 0, 3, 0, 0, 3]  # every 3rd: 30 phases over a bound of 12
    assert len(thinned(many, limit=11)[9].get("phases", ())) == 0  # not past the bound
    assert thinned(many, limit=30) == many
