"""Simulator speed and the headline figures, as one JSON line.

    python bench/simulate.py [--iterations 50] [--prompts 1024] [--samples 8] [--gpus 160]

Times the simulation of ``--iterations`` iterations of ``--prompts`` x ``--samples`` on
``--gpus`` H100s with Llama2-70B (the RLHFless paper's simulated setting) under our full
elastic policy (length prediction, scaling, assignment, cut-and-migrate), trace generation
included. Then simulates the paper's two settings (``rlhfless simulate`` without a scenario,
no sweeps) and reports, per setting, our speedup and GPU-second change vs ``verl-0.3`` (the
paper's baseline) and ``verl-tuned``, the paper's mechanisms alone, the bound of any
scheduler given the update, our policy at the lambda where its speed meets the paper's
(the GPU-s change there), and the paper's figures beside them; and PAT's two settings:
generation and step time change against the same static TP (TP 1 and 2) and generation
against the fastest static TP.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from rlhfless.pipeline.sim.simulate import paper_scenarios, pat_scenarios, run_pat, run_scenario
from rlhfless.schedulers.profiles import get_profile
from rlhfless.schedulers.sim.sim_policy import ELASTIC
from rlhfless.schedulers.sim.simulator import ClusterConfig, simulate
from rlhfless.schedulers.sim.workloads import GSM8K, synthetic_trace


def _operating_point(point: dict[str, float] | None) -> dict[str, float] | None:
    if point is None:
        return None
    return {"lambda_cost": round(point["lambda_cost"], 3), "speedup": round(point["speedup"], 3),
            "gpu_s_change": round(-point["gpu_s_reduction"], 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--gpus", type=int, default=160)
    args = parser.parse_args(argv)
    workload = dataclasses.replace(GSM8K, iterations=args.iterations,
                                   batch_prompts=args.prompts, n_samples=args.samples)
    profile = get_profile("Llama2-70B@H100")
    started, cpu_started = time.perf_counter(), time.process_time()
    result = simulate(synthetic_trace(workload), profile, ClusterConfig(args.gpus), ELASTIC)
    seconds = time.perf_counter() - started
    summary = result.summary()
    headline = {}
    for sc in paper_scenarios():
        rep = run_scenario(sc, sweeps=False)
        rows = {r["label"]: r for r in rep["table"]}
        ours, mech, bound = rows["rlhfless (ours)"], rows["+cut-and-migrate"], rep["bound"]
        headline[sc.name] = {
            "speedup": round(ours["speedup"], 3), "paper_speedup": sc.paper["speedup"],
            "gpu_s_change": round(-ours["gpu_s_reduction"], 3),
            "paper_gpu_s_change": -sc.paper["reduction"],
            "paper_mechanisms_speedup": round(mech["speedup"], 3),
            "paper_mechanisms_gpu_s_change": round(-mech["gpu_s_reduction"], 3),
            "bound_speedup": round(bound["speedup"], 3),
            "bound_gpu_s_change": round(-bound["gpu_s_reduction"], 3),
            "speedup_vs_tuned": round(ours["speedup_tuned"], 3),
            "gpu_s_change_vs_tuned": round(-ours["gpu_s_reduction_tuned"], 3),
            "oracle_share": round(ours["gpu_s_reduction"] / rows["oracle"]["gpu_s_reduction"], 3),
            "at_paper_speed": _operating_point(rep["at_paper_speed"]),
            "baseline_tp": rep["baseline_tp"]}
    pat = {}
    for sc in pat_scenarios():
        rep = run_pat(sc)
        rows = {r["tp"]: r for r in rep["rows"]}
        pat[sc.name] = {f"tp{t}": {"gen_change": round(rows[t]["gen_change"], 3),
                                   "step_change": round(rows[t]["step_change"], 3),
                                   "bound_gen_change": round(rows[t]["bound_gen_change"], 3),
                                   "gen_change_vs_fastest": round(
                                       rows[t]["gen_change_vs_fastest"], 3)}
                        for t in (1, 2) if t in rows}
        pat[sc.name]["fastest_static_tp"] = rep["best_static_tp"]
        pat[sc.name].update({f"paper_{k}": v for k, v in sc.paper.items()})
    print(json.dumps({
        "bench": "simulate", "iterations": args.iterations, "prompts": args.prompts,
        "samples": args.samples, "gpus": args.gpus, "profile": profile.name,
        "policy": ELASTIC.name, "seconds": round(seconds, 2),
        "ms_per_iteration": round(1e3 * seconds / args.iterations, 1),
        "simulated_step_s": round(summary["step_s"], 2),
        "migrations": summary["migrations"], "headline": headline, "pat": pat,
        "total_seconds": round(time.perf_counter() - started, 1),
        "total_cpu_seconds": round(time.process_time() - cpu_started, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
