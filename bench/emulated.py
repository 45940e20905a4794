"""The live runtime on emulated GPUs next to the simulator, same trace, same policy.

    .venv/bin/python bench/emulated.py [--workers 16 64] [--iterations 3] [--time-scale 0.05]

The paper-physical scenario (``pipeline/sim/simulate.py``: Qwen2.5-3B on L40S, GSM8K-like
lengths, 1,024 prompts x 8 samples, a 16-GPU learner) runs on 16 and 64 emulated generation
workers, elastic and static, through ``pipeline/train/emulated.run_emulated`` (real Dask worker
processes, plugin, ledger, ``ElasticGeneration``; generation and update timed by the
profile), and through the simulator with the same trace, profile (``as_live``), learner and
policy knobs. Prints one JSON line: per configuration, step seconds and generation
worker-seconds of both (emulated seconds) and their ratio, over all iterations and over the
warm ones (from the second on), the runtime's overhead per iteration (seconds in which no
emulated task ran, the driver's scaling seconds, transfers) in seconds and as a share, the
measured cold starts, and the worker processes' peak memory. Start-up of the pool (before the
first iteration) is in the run totals only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

import numpy as np

# Worker processes start by spawn, which imports this script's top level in each of them:
# only what an emulated generation worker needs anyway is imported here (no torch), the
# driver's modules inside main().


def _mean(xs) -> float:
    return float(np.mean(xs)) if len(xs) else float("nan")


def compare(live: dict, sim) -> dict:
    """Step seconds and generation worker-seconds per iteration, live vs simulated."""
    its = sim.iterations
    sim_ws = [sim.ledger.worker_seconds("gen", until=i.update_end)
              - sim.ledger.worker_seconds("gen", until=i.t_start) for i in its]
    rows = live["iterations"]
    out = {}
    for part, keep in (("all", slice(None)), ("warm", slice(1, None))):
        ls, ss = [r["step_s"] for r in rows][keep], [i.step_s for i in its][keep]
        lw, sw = [r["gen_worker_s"] for r in rows][keep], sim_ws[keep]
        out[part] = {"live_step_s": _mean(ls), "sim_step_s": _mean(ss),
                     "step_ratio": _mean(ls) / _mean(ss),
                     "live_gen_worker_s": _mean(lw), "sim_gen_worker_s": _mean(sw),
                     "gen_worker_s_ratio": _mean(lw) / _mean(sw)}
        out[part]["within_10pct"] = bool(abs(out[part]["step_ratio"] - 1) <= 0.1
                                         and abs(out[part]["gen_worker_s_ratio"] - 1) <= 0.1)
    out["run"] = {"live_total_s": live["total_s"], "sim_total_s": sim.t_end,
                  "live_gen_worker_s": live["gen_worker_s"],
                  "sim_gen_worker_s": sim.ledger.worker_seconds("gen", until=sim.t_end)}
    out["per_iteration"] = [
        {"live_step_s": r["step_s"], "sim_step_s": i.step_s, "live_gen_worker_s":
         r["gen_worker_s"], "sim_gen_worker_s": w, "live_workers": r["gen_workers"],
         "sim_workers": i.n_workers, "live_migrated": r.get("migrated_sequences", 0),
         "sim_moved": i.moved_sequences, "overhead_s": r["overhead_s"],
         "overhead_share": r["overhead_share"], "overhead_wall_s": r["overhead_wall_s"],
         "scaling_wall_s": r["scaling_wall_s"], "transfer_wall_s": r["transfer_wall_s"],
         "late_wall_s": r["late_wall_s"], "emulated_path_s": r["emulated_path_s"],
         "runtime_s": r["runtime_s"], "every_sample_once": r["samples"] == r["distinct_samples"]}
        for r, i, w in zip(rows, its, sim_ws)]
    out["overhead_per_iteration"] = {
        "s": _mean([r["overhead_s"] for r in rows]),
        "wall_s": _mean([r["overhead_wall_s"] for r in rows]),
        "share": _mean([r["overhead_share"] for r in rows]),
        "scaling_wall_s": _mean([r["scaling_wall_s"] for r in rows]),
        "transfer_wall_s": _mean([r["transfer_wall_s"] for r in rows]),
        "late_wall_s": _mean([r["late_wall_s"] for r in rows]),
        "runtime_s": _mean([r["runtime_s"] for r in rows]),
        "runtime_share": _mean([r["runtime_s"] / r["step_s"] for r in rows])}
    out["cold_starts_s"] = {"live": [round(c, 1) for c in live["cold_starts_s"]],
                            "profile": sim.profile.gen_cold_start_s}
    out["memory_peak"] = live["memory_peak"]
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[16, 64])
    p.add_argument("--policies", nargs="+", default=["elastic", "static"])
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--time-scale", type=float, default=0.05)
    args = p.parse_args(argv)
    from rlhfless.pipeline.config import make_config
    from rlhfless.pipeline.sim.simulate import paper_scenarios
    from rlhfless.pipeline.train.emulated import as_live, run_emulated, simulator_policy
    from rlhfless.schedulers.sim.simulator import ClusterConfig, simulate
    from rlhfless.schedulers.sim.workloads import synthetic_trace

    scenario = paper_scenarios()[0]  # paper-physical
    trace = synthetic_trace(dataclasses.replace(scenario.workload, iterations=args.iterations))
    train_gpus = scenario.gpus  # the scenario's learner: 16 GPUs
    profile = as_live(scenario.profile)
    result = {"bench": "emulated", "scenario": scenario.name, "profile": profile.name,
              "iterations": args.iterations, "time_scale": args.time_scale,
              "train_gpus": train_gpus, "batch": [trace.batches[0].n_groups, trace.n_samples],
              "configs": {}}
    for workers in args.workers:
        for policy in args.policies:
            cfg = make_config({
                "backend": "emulated", "policy": policy, "gen_workers": workers,
                "n_samples": trace.n_samples, "batch_prompts": trace.batches[0].n_groups,
                "max_new_tokens": trace.max_response_tokens, "worker_memory": "1GiB",
                "emulate_profile": scenario.profile.name, "emulate_time_scale": args.time_scale})
            started, name = time.time(), f"{policy}-{workers}"
            sim = simulate(trace, profile, ClusterConfig(workers, train_gpus, colocated=False),
                           simulator_policy(cfg))
            try:
                with tempfile.TemporaryDirectory() as run_dir:
                    live = run_emulated(cfg, trace, run_dir, train_gpus=train_gpus)
                row = {"wall_s": time.time() - started, **compare(live, sim)}
            except Exception as err:  # said in the result; the other configurations still run
                row = {"wall_s": time.time() - started, "error": f"{type(err).__name__}: {err}"}
            result["configs"][name] = row
            print(f"{name}: {json.dumps(row)}", file=sys.stderr, flush=True)
    result["load_avg"] = os.getloadavg()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
