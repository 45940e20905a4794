"""PAT through the one driver: an emulated 8-GPU pool reconfigures its tail, vs static TP 1.

    .venv/bin/python bench/emulated_pat.py [--model Llama3.1-8B] [--iterations 3]
        [--time-scale 0.25] [--tau 0.02]

PAT's setting (``pipeline/sim/simulate.py: pat_scenarios``): one node of 8 H100, 128 prompts
x 8 samples of DeepScaleR-like long chain-of-thought lengths. Two runs of ``train(cfg)``
with ``backend = "emulated"`` (real Dask workers, driver, ledger; decode steps on the
profile's clock), on the same trace, one after the other:

- *static*: 8 generation workers of TP 1, each decoding its shard to the end;
- *elastic*: the same 8 (``gen_min_workers = 8``, kept through the update as the node's
  GPUs are: ``keep_alive_s``) with ``tail_action = "auto"``: at ``tau``
  the pool pauses and the policy chooses among staying, moving, splitting and
  reconfiguring, timed by the engine's step profile at each width (the emulated engine's
  ``widen`` is PAT's TP change: the profile re-derived at TP ``m``, ``pat.RECONFIG_FIXED_S``
  and the KV transfer on its links charged).

And the simulator on the same trace: static TP 1 and PAT from TP 1 (``VERL_TUNED``, the
policy ``rlhfless simulate`` reports PAT with), on the same 8 GPUs and learner.

Prints one JSON line: per iteration and over the warm ones (from the second: the first
starts the workers), each run's generation latency (emulated seconds: the iteration's last
rollout end less its first generation start, on the wall, over the time scale), the
elastic/static change, the simulator's, each run's latency over the simulator's (static
over static, elastic over PAT; ``within_10pct_of_sim`` when both are), the tail decisions
(action, predicted and actual seconds) and whether every (prompt, sample) was generated
once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import pyarrow.parquet as pq

# Worker processes start by spawn, which imports this script's top level in each of them:
# the driver's modules are imported inside main().


def generation_latency(run, iteration: int, scale: float) -> tuple[float, bool]:
    """An iteration's generation latency in emulated seconds, and whether every (prompt,
    sample) came once."""
    table = pq.read_table(run.path / "rollouts" / f"iter-{iteration:05d}.parquet",
                          columns=["prompt_id", "sample_idx", "gen_start", "gen_end"])
    pairs = list(zip(table.column("prompt_id").to_pylist(),
                     table.column("sample_idx").to_pylist()))
    start = float(np.min(table.column("gen_start").to_numpy()))
    end = float(np.max(table.column("gen_end").to_numpy()))
    return (end - start) / scale, len(pairs) == len(set(pairs))


def tail_decisions(run) -> list[dict]:
    """The run's tail decisions (a static run makes none)."""
    path = run.path / "decisions.jsonl"
    keep = ("iteration", "action", "predicted_stay_s", "predicted_s", "actual_s",
            "sequences_moved")
    return [{k: d.get(k) for k in keep} for d in map(
        json.loads, path.read_text().splitlines() if path.exists() else [])
        if d["kind"] == "tail"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="Llama3.1-8B", choices=["Llama3.1-8B", "Qwen3-14B"])
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--time-scale", type=float, default=0.25)
    p.add_argument("--tau", type=float, default=0.02)
    args = p.parse_args(argv)
    from rlhfless.pipeline.config import make_config
    from rlhfless.pipeline.sim.simulate import pat_scenarios
    from rlhfless.pipeline.train.emulation import Emulation
    from rlhfless.pipeline.train.loop import train
    from rlhfless.schedulers.sim.sim_policy import VERL_TUNED
    from rlhfless.schedulers.sim.simulator import ClusterConfig, simulate

    scenario = next(s for s in pat_scenarios() if s.profile.name.startswith(args.model))
    work, gpus, learner = scenario.workload, scenario.gpus, scenario.gpus
    result = {"bench": "emulated_pat", "driver": "train(cfg)", "scenario": scenario.name,
              "profile": scenario.profile.name, "gpus": gpus, "tau": args.tau,
              "batch": [work.batch_prompts, work.n_samples], "iterations": args.iterations,
              "time_scale": args.time_scale, "runs": {}}
    trace = None
    for name, policy in (("static", {"policy": "static"}),
                         ("elastic", {"policy": "elastic", "gen_min_workers": gpus,
                                      "keep_alive_s": 1e6, "tail_action": "auto",
                                      "tau": args.tau})):
        started = time.time()
        with tempfile.TemporaryDirectory() as runs:
            cfg = make_config({
                "backend": "emulated", "gen_workers": gpus, "iterations": args.iterations,
                "n_samples": work.n_samples, "batch_prompts": work.batch_prompts,
                "max_new_tokens": work.max_response_tokens, "worker_memory": "1GiB",
                "emulate_workload": work.name, "emulate_train_gpus": learner,
                "emulate_profile": scenario.profile.name,
                "emulate_time_scale": args.time_scale, "heldout_prompts": 8,
                "eval_every": args.iterations, "on_collapse": "warn", "runs_dir": runs,
                "name": name, **policy})
            trace = trace or Emulation.of(cfg).trace.head(args.iterations)
            run = train(cfg, progress=False, log=lambda _: None)
            its = [generation_latency(run, i + 1, args.time_scale)
                   for i in range(args.iterations)]
            result["runs"][name] = {"gen_s": [g for g, _ in its],
                                    "every_sample_once": all(o for _, o in its),
                                    "tail_decisions": tail_decisions(run),
                                    "wall_s": time.time() - started}
        print(f"{name}: {json.dumps(result['runs'][name])}", file=sys.stderr, flush=True)
    cluster = ClusterConfig(gpus, learner, colocated=False)
    sim = {name: [it.gen_s for it in simulate(trace, scenario.profile, cluster,
                                              VERL_TUNED.replace(tp=1, pat=pat)).iterations]
           for name, pat in (("static", False), ("pat", True))}
    warm = slice(1, None)
    live_static = float(np.mean(result["runs"]["static"]["gen_s"][warm]))
    live_pat = float(np.mean(result["runs"]["elastic"]["gen_s"][warm]))
    sim_static, sim_pat = (float(np.mean(sim[k][warm])) for k in ("static", "pat"))
    live_change, sim_change = live_pat / live_static - 1, sim_pat / sim_static - 1
    result["sim_gen_s"] = sim
    result["warm"] = {"live_static_s": live_static, "live_elastic_s": live_pat,
                      "sim_static_s": sim_static, "sim_pat_s": sim_pat,
                      "live_change": live_change, "sim_change": sim_change,
                      "paper_change": scenario.paper.get("gen_change"),
                      "static_vs_sim": live_static / sim_static,
                      "elastic_vs_sim_pat": live_pat / sim_pat,
                      "change_points_vs_sim": live_change - sim_change,
                      "within_10pct_of_sim": bool(abs(live_static / sim_static - 1) <= 0.1
                                                  and abs(live_pat / sim_pat - 1) <= 0.1)}
    result["load_avg"] = os.getloadavg()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
