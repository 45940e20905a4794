"""Emulated pools through the one driver, next to the simulator: same trace, same policy.

    .venv/bin/python bench/emulated.py [--workers 16 64] [--policies elastic static]
        [--modes sync] [--iterations 3] [--time-scale 0.25]

The paper-physical scenario (``pipeline/sim/simulate.py``: Qwen2.5-3B on L40S, GSM8K-like
lengths, 1,024 prompts x 8 samples, a 16-GPU learner) runs with ``backend = "emulated"``
through ``train(cfg)``, the driver of every run (real Dask worker processes, plugin, ledger,
the mode runner, the elastic controller or the static graph, checkpoints, evaluation;
generation and update timed by the profile), on 16 and 64 emulated generation workers, and
through the simulator with the same trace, profile (``as_live``), learner and policy knobs.
Prints one JSON line: per configuration, step seconds and generation worker-seconds of both
(emulated seconds) and their ratio, over all iterations and over the warm ones (from the
second on), whether every (prompt, sample) was trained once, the runtime's own seconds per
iteration (the step's wall less the emulated work on its critical path: the longest shard's
generation plus the update), and the worker processes' peak memory. The simulator's
figures are for sync mode; an async row has no simulator figure beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import psutil
import pyarrow.parquet as pq

# Worker processes start by spawn, which imports this script's top level in each of them:
# only what an emulated generation worker needs anyway is imported here (no torch), the
# driver's modules inside main().


def _mean(xs) -> float:
    return float(np.mean(xs)) if len(xs) else float("nan")


def worker_memory() -> dict:
    """RSS and USS (unique pages) of this process's children, GiB, and their count."""
    kids = psutil.Process().children(recursive=True)
    rss = uss = 0
    for kid in kids:
        try:
            info = kid.memory_full_info()
        except psutil.Error:  # exited meanwhile
            continue
        rss, uss = rss + info.rss, uss + info.uss
    return {"processes": len(kids), "rss_gib": rss / 2**30, "uss_gib": uss / 2**30}


def live_rows(run, scale: float) -> list[dict]:
    """Per iteration of the run: emulated step seconds, generation worker-seconds (the
    ledger's, emulated), the runtime's own wall seconds, and whether each (prompt, sample)
    was trained once."""
    rows = []
    for rec in (r for r in run.metrics() if r.get("event") == "iteration"):
        table = pq.read_table(run.path / "rollouts" / f"iter-{rec['iteration']:05d}.parquet",
                              columns=["prompt_id", "sample_idx"])
        pairs = set(zip(table.column("prompt_id").to_pylist(),
                        table.column("sample_idx").to_pylist()))
        path = rec["gen_path_s"] + rec["update_seconds"]
        rows.append({"step_s": rec["iteration_s"] / scale, "gen_worker_s": rec["gen_worker_s"],
                     "gen_workers": rec.get("gen_workers"), "samples": rec["samples"],
                     "every_sample_once": len(pairs) == rec["samples"],
                     "migrated": rec.get("migrated_sequences", 0),
                     "runtime_wall_s": rec["iteration_s"] - path * scale})
    return rows


def compare(rows: list[dict], sim) -> dict:
    """Step seconds and generation worker-seconds per iteration, live vs simulated."""
    its = sim.iterations if sim is not None else []
    sim_ws = [sim.ledger.worker_seconds("gen", until=i.update_end)
              - sim.ledger.worker_seconds("gen", until=i.t_start) for i in its]
    out = {}
    for part, keep in (("all", slice(None)), ("warm", slice(1, None))):
        ls, lw = [r["step_s"] for r in rows][keep], [r["gen_worker_s"] for r in rows][keep]
        out[part] = {"live_step_s": _mean(ls), "live_gen_worker_s": _mean(lw)}
        if sim is None:
            continue
        ss, sw = [i.step_s for i in its][keep], sim_ws[keep]
        out[part] |= {"sim_step_s": _mean(ss), "step_ratio": _mean(ls) / _mean(ss),
                      "sim_gen_worker_s": _mean(sw), "gen_worker_s_ratio": _mean(lw) / _mean(sw)}
        out[part]["within_10pct"] = bool(abs(out[part]["step_ratio"] - 1) <= 0.1
                                         and abs(out[part]["gen_worker_s_ratio"] - 1) <= 0.1)
    out["every_sample_once"] = all(r["every_sample_once"] for r in rows)
    out["runtime_wall_s_per_iteration"] = _mean([r["runtime_wall_s"] for r in rows])
    out["per_iteration"] = [
        r | ({"sim_step_s": i.step_s, "sim_gen_worker_s": w, "sim_workers": i.n_workers,
              "sim_moved": i.moved_sequences} if sim is not None else {})
        for r, i, w in zip(rows, its or [None] * len(rows), sim_ws or [None] * len(rows))]
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[16, 64])
    p.add_argument("--policies", nargs="+", default=["elastic", "static"])
    p.add_argument("--modes", nargs="+", default=["sync"])
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--time-scale", type=float, default=0.25)
    args = p.parse_args(argv)
    from rlhfless.pipeline.config import make_config
    from rlhfless.pipeline.sim.simulate import paper_scenarios
    from rlhfless.pipeline.train.emulation import Emulation, as_live, simulator_policy
    from rlhfless.pipeline.train.loop import train
    from rlhfless.schedulers.sim.simulator import ClusterConfig, simulate

    scenario = paper_scenarios()[0]  # paper-physical
    work = scenario.workload
    result = {"bench": "emulated", "driver": "train(cfg)", "scenario": scenario.name,
              "profile": scenario.profile.name, "iterations": args.iterations,
              "time_scale": args.time_scale, "train_gpus": scenario.gpus,
              "batch": [work.batch_prompts, work.n_samples], "configs": {}}
    for workers in args.workers:
        for policy in args.policies:
            for mode in args.modes:
                name = f"{policy}-{workers}" + ("" if mode == "sync" else f"-{mode}")
                started, peak = time.time(), {"rss_gib": 0.0}

                def sample_memory(record: dict) -> None:
                    nonlocal peak
                    memory = worker_memory()
                    peak = memory if memory["rss_gib"] > peak["rss_gib"] else peak

                with tempfile.TemporaryDirectory() as runs:
                    cfg = make_config({
                        "backend": "emulated", "policy": policy, "mode": mode,
                        "gen_workers": workers, "iterations": args.iterations,
                        "n_samples": work.n_samples, "batch_prompts": work.batch_prompts,
                        "max_new_tokens": work.max_response_tokens, "worker_memory": "1GiB",
                        "emulate_workload": work.name, "emulate_train_gpus": scenario.gpus,
                        "emulate_profile": scenario.profile.name,
                        "emulate_time_scale": args.time_scale, "heldout_prompts": 8,
                        "eval_every": args.iterations, "on_collapse": "warn",
                        "runs_dir": runs, "name": name})
                    trace = Emulation.of(cfg).trace.head(args.iterations)
                    sim = simulate(trace, as_live(scenario.profile),
                                   ClusterConfig(workers, scenario.gpus, colocated=False),
                                   simulator_policy(cfg)) if mode == "sync" else None
                    try:
                        run = train(cfg, progress=False, log=lambda _: None,
                                    on_metrics=sample_memory)
                        row = {"wall_s": time.time() - started,
                               **compare(live_rows(run, args.time_scale), sim)}
                    except Exception as err:  # said in the result; the others still run
                        row = {"wall_s": time.time() - started,
                               "error": f"{type(err).__name__}: {err}"}
                row["memory_peak"] = peak
                result["configs"][name] = row
                print(f"{name}: {json.dumps(row)}", file=sys.stderr, flush=True)
    result["load_avg"] = os.getloadavg()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
