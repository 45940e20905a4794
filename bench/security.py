"""What the secure default costs: the default task with and without the run's TLS.

Trains the embedded tiny model with the default configuration (batch, samples, lengths,
pools) for ``--iterations`` iterations per run, once with the default ``[security]`` (TLS,
mutual authentication, per-run credentials) and once with ``enabled = false`` (plain tcp),
alternating ABBA over ``--repeats`` pairs so that a drift in the machine's load weighs on
both alike. Per-iteration seconds come from each run's ``metrics.jsonl`` (``iteration_s``);
the cluster's start (TLS handshakes of every worker included) is timed apart. Held-out
evaluation is cut to a few prompts and done only at the start and the end (outside the
iteration times). ``iteration_s`` is the median over the iterations after each run's first;
``iteration_cpu_s`` the same for the CPU seconds of the driver (scheduler included) and every
worker process, which a busy neighbour on a shared machine disturbs far less than wall time.
Prints one JSON line.

    python bench/security.py [--iterations 6] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from statistics import mean, median

import psutil

from rlhfless.pipeline.config import Config
from rlhfless.pipeline.train.loop import train

SETTINGS = {"tls": {}, "plain": {"enabled": False}}


def run_once(setting: str, index: int, iterations: int, runs_dir: str) -> dict:
    cfg = Config(name=f"{setting}-{index}", runs_dir=runs_dir, iterations=iterations,
                 heldout_prompts=8, eval_every=iterations, checkpoint_every=iterations,
                 security=SETTINGS[setting])
    started, cpu = {}, []

    def on_metrics(record: dict) -> None:
        started.setdefault("first", time.perf_counter())
        if record.get("event") in ("iteration", "eval") and record.get("iteration") is not None:
            cpu.append((record["event"], cpu_seconds()))

    t0 = time.perf_counter()
    run = train(cfg, progress=False, log=lambda *_: None, on_metrics=on_metrics)
    records = [r for r in run.metrics() if r.get("event") == "iteration"]
    # CPU of one iteration: from the record before it (an iteration's, or the first eval's)
    # to its own; an eval in between would count, so there is none until the last
    marks = [c for _, c in cpu[:-1]] if cpu and cpu[-1][0] == "eval" else [c for _, c in cpu]
    return {"iteration_s": [r["iteration_s"] for r in records],
            "iteration_cpu_s": [b - a for a, b in zip(marks, marks[1:])],
            "start_s": started["first"] - t0, "total_s": time.perf_counter() - t0}


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and every live child (the workers)."""
    me = psutil.Process()
    total = 0.0
    for proc in (me, *me.children(recursive=True)):
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    order = [s for i in range(args.repeats)
             for s in (("tls", "plain", "plain", "tls") if i % 2 == 0 else ("plain", "tls"))]
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    with tempfile.TemporaryDirectory() as runs_dir:
        for index, setting in enumerate(order):
            runs[setting].append(run_once(setting, index, args.iterations, runs_dir))
    # the median of the iterations after each run's first (which also warms every engine):
    # robust to a neighbour's burst on a shared machine
    per_iteration = {s: median(t for r in rs for t in r["iteration_s"][1:])
                     for s, rs in runs.items()}
    cpu_per_iteration = {s: median(t for r in rs for t in r["iteration_cpu_s"][1:])
                         for s, rs in runs.items()}
    print(json.dumps({
        "iterations_per_run": args.iterations, "runs": {s: len(rs) for s, rs in runs.items()},
        "iteration_s": per_iteration,
        "iteration_s_each": {s: [[round(t, 3) for t in r["iteration_s"]] for r in rs]
                             for s, rs in runs.items()},
        "tls_over_plain_iteration": per_iteration["tls"] / per_iteration["plain"],
        "iteration_cpu_s": cpu_per_iteration,
        "tls_over_plain_iteration_cpu": cpu_per_iteration["tls"] / cpu_per_iteration["plain"],
        "start_s": {s: mean(r["start_s"] for r in rs) for s, rs in runs.items()},
        "load_1m": os.getloadavg()[0],
    }))


if __name__ == "__main__":
    main()
