"""Static vs elastic scheduling on a LocalCluster: worker-seconds, wall time, accuracy.

Both runs use the same model (the embedded tiny default), seeds, data order, iterations and
pool maximum (``--gen-workers``). Static keeps every generation worker and the trainer for
the whole run (the serverful baseline of veRL / OpenRLHF); elastic lets the cost model pick
the generation pool per iteration, cut and migrate straggling tails, and release idle
workers. Worker-seconds come from each run's cost ledger (billed from the request of a
worker to the exit of its process). Prints one JSON line.

    python bench/elastic.py [--iterations 12] [--gen-workers 3] [--lambda-cost 0.5]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from rlhfless.ops.toy.tinymodel import ensure_tiny_model
from rlhfless.pipeline.config import Config
from rlhfless.pipeline.train.loop import train


def run_policy(policy: str, args, runs_dir: str) -> dict:
    cfg = Config(name=policy, runs_dir=runs_dir, policy=policy, iterations=args.iterations,
                 eval_every=args.iterations, gen_workers=args.gen_workers,
                 lambda_cost=args.lambda_cost, seed=args.seed)
    started = time.perf_counter()
    run = train(cfg, progress=False, log=lambda *_: None)
    wall = time.perf_counter() - started
    ledger = run.read_json("ledger.json")["totals"]
    evals = [m for m in run.metrics() if m.get("event") == "eval"]
    iters = [m for m in run.metrics() if m.get("event") == "iteration"]
    return {
        "wall_s": round(wall, 2),
        "worker_s": round(ledger["worker_s"], 2),
        "gen_worker_s": round(ledger["gen_worker_s"], 2),
        "train_worker_s": round(ledger["train_worker_s"], 2),
        "heldout_accuracy_start": evals[0]["heldout_accuracy"],
        "heldout_accuracy_end": evals[-1]["heldout_accuracy"],
        "reward_mean_last3": sum(m["reward_mean"] for m in iters[-3:]) / 3,
        "mean_gen_workers": sum(m.get("gen_workers", args.gen_workers) for m in iters)
        / len(iters),
        "migrated_sequences": sum(m.get("migrated_sequences", 0) for m in iters),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--gen-workers", type=int, default=3)
    parser.add_argument("--lambda-cost", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ensure_tiny_model(log=lambda *_: None)  # build outside the timed runs
    with tempfile.TemporaryDirectory() as runs_dir:
        results = {policy: run_policy(policy, args, runs_dir) for policy in ("static", "elastic")}
    static, elastic = results["static"], results["elastic"]
    print(json.dumps({
        "bench": "elastic", "iterations": args.iterations, "gen_workers_max": args.gen_workers,
        "lambda_cost": args.lambda_cost, **results,
        "worker_s_ratio": round(elastic["worker_s"] / static["worker_s"], 3),
        "gen_worker_s_ratio": round(elastic["gen_worker_s"] / static["gen_worker_s"], 3),
        "wall_ratio": round(elastic["wall_s"] / static["wall_s"], 3),
    }))


if __name__ == "__main__":
    main()
