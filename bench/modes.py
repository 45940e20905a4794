"""Sync vs async vs replay vs async+replay at the same wall-clock budget: throughput and
held-out accuracy.

Each mode trains the embedded tiny model with the same seeds, data order and pools (one
LocalCluster per run, all of one configuration) for ``--budget-s`` seconds of training
(``max_wall_s``: the iteration that crosses the budget still finishes). With ``--repeats 2``
the runs go through the modes and back in reverse order, so that a drift in the machine's
load weighs on every mode alike; throughput and accuracy are averaged over the repeats.

Every published version is kept. Afterwards, on one cluster and outside the timed runs, the
version each run had reached at a few common wall times and sample counts is evaluated on
the same held-out prompts (greedy decoding, as the training loop's evaluation; by default
all 256 of the tiny task's). ``accuracy_at_budget_minus_sync`` gives each mode's difference
at the budget with its standard error over the held-out prompts, paired (every run answers
the same prompts): the mean over a mode's runs of each prompt's reward, minus sync's, then
the mean and ``std / sqrt(n)`` of those differences. It does not include the spread between
training runs; ``accuracy_at_budget_each_run`` shows that.

``replay-longest`` is mode replay with ``replay_longest = true``: the replayed groups
replace the prompts of the batch predicted longest (pipeline/train/modes.py) rather than the last
drawn. Its row-count Amdahl bound below would not bound it, so none is given.

Throughput is samples trained (fresh and replayed) per second of training, from the first
iteration's start to the last one's end. ``amdahl_bound_vs_sync`` is the most each mode could
gain on the sync runs' own stage times, with no contention: async hides generation behind
everything else, ``t / max(g, t - g)``; replay removes the replayed share r of it,
``t / (t - r g)``; async+replay adds the replayed rows on top of a whole fresh batch (fill),
``t / (1 - r) / max(g, (t - g) / (1 - r))`` (t: sync seconds per iteration, g: its
generation seconds).

The default pools give the generation pool and the trainer a core each (``--gen-workers 1
--train-threads 1``), the disaggregated setting that async and replay address: a synchronous
run leaves one pool idle while the other works. Prints one JSON line.

    python bench/modes.py [--budget-s 90] [--repeats 2] [--gen-workers 1] [--train-threads 1]
                          [--modes sync,async,replay,async+replay] [--replay-max-age 3]
                          [--tis-cap 2.0] [--replay-share adaptive]
                          [--replay-max-grad-share 0.5] [--replay-age-decay 1.0]
                          [--replay-max-skips 1] [--heldout 256]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from statistics import mean

import numpy as np

from rlhfless.ops.engine.engine_types import WeightsRef
from rlhfless.ops.toy.tinymodel import ensure_tiny_model
from rlhfless.pipeline.cluster.pools import PoolCluster, pools_from_config
from rlhfless.pipeline.config import Config
from rlhfless.pipeline.durable.runs import RunDir
from rlhfless.pipeline.train.evaluation import heldout_rollouts
from rlhfless.pipeline.train.loop import load_prompt_sets, make_specs, resolve_model, train
from rlhfless.schedulers.ledger import CostLedger

MODES = ("sync", "async", "replay", "async+replay")
# a bench mode beside the config's: replay whose groups replace the prompts predicted longest
LONGEST = "replay-longest"
FRACTIONS = (0.25, 0.5, 0.75, 1.0)
# replay diagnostics (ops/replay/stats.py, ops/algo/update.py), averaged over iterations
DIAGNOSTICS = ("replay_share", "replay_grad_token_share", "replay_age_mean",
               "tis_weight_mean_older", "fresh_informative_frac", "response_len_mean",
               "response_len_max", "fresh_reward_mean", "replayed_reward_mean")


def make_cfg(name: str, mode: str, args, runs_dir: str) -> Config:
    longest = mode == LONGEST
    return Config(name=name, runs_dir=runs_dir, mode="replay" if longest else mode,
                  replay_longest=longest, replay_max_skips=args.replay_max_skips,
                  seed=args.seed, lr=args.lr,
                  iterations=100_000, max_wall_s=args.budget_s, eval_every=100_000,
                  checkpoint_every=100_000, keep_weights=100_000, heldout_prompts=args.heldout,
                  policy=args.policy, gen_workers=args.gen_workers,
                  train_threads=args.train_threads, batch_prompts=args.batch_prompts,
                  n_samples=args.n_samples, max_staleness=args.max_staleness,
                  replay_ratio=args.replay_ratio, replay_max_age=args.replay_max_age,
                  tis_cap=args.tis_cap, replay_share=args.replay_share,
                  replay_max_grad_share=args.replay_max_grad_share,
                  replay_age_decay=args.replay_age_decay)


def run_once(name: str, mode: str, args, runs_dir: str) -> dict:
    """Train ``mode`` for the budget; per iteration: seconds since training started,
    samples trained so far, the version it published, and its record."""
    load = os.getloadavg()[0]
    run = train(make_cfg(name, mode, args, runs_dir), progress=False, log=lambda *_: None)
    records = [m for m in run.metrics() if m.get("event") == "iteration"]
    start = records[0]["time"] - records[0]["iteration_s"]
    points, samples = [], 0
    for m in records:
        samples += m["samples"]
        points.append({"t": m["time"] - start, "samples": samples,
                       "version": m["policy_version"] + 1})
    n = len(records)
    return {"weights": run.weights, "points": points, "loadavg_1m": load,
            "iterations": n, "samples": samples, "samples_per_s": samples / points[-1]["t"],
            "s_per_iteration": points[-1]["t"] / n,
            "generate_s_per_iteration": sum(m.get("generate_wall_s", 0.0) for m in records) / n,
            "update_s_per_iteration": sum(m.get("update_wall_s", 0.0) for m in records) / n,
            "staleness_mean": mean(m.get("staleness_mean", 0.0) for m in records),
            "replayed_frac": sum(m.get("replayed_samples", 0) for m in records) / samples,
            **{key: mean(m.get(key, 0.0) for m in records) for key in DIAGNOSTICS}}


def version_at(points: list[dict], key: str, limit: float) -> int:
    """The newest version published by the time ``key`` reached ``limit`` (0: none yet)."""
    return max([p["version"] for p in points if p[key] <= limit], default=0)


def accuracy_of(runs: list[dict], wanted: set[tuple[int, int]], args,
                runs_dir: str) -> dict[tuple[int, int], np.ndarray]:
    """Each (run index, version)'s held-out rewards, one per prompt in ``prompt_id`` order
    (greedy: 1 right, 0 wrong), on one cluster."""
    cfg = make_cfg("eval", "sync", args, runs_dir)
    model_path = resolve_model(cfg, log=lambda *_: None)
    _, heldout, _ = load_prompt_sets(cfg, model_path)
    specs = make_specs(cfg, model_path, RunDir(Path(runs_dir) / "eval"))
    out: dict[tuple[int, int], np.ndarray] = {}
    with PoolCluster(pools_from_config(cfg), CostLedger(cfg.prices)) as pc:
        for key in sorted(wanted):
            i, version = key
            if version == 0 and (0, 0) in out:  # every run starts from the same weights
                out[key] = out[0, 0]
                continue
            ref = (WeightsRef(0, str(model_path)) if version == 0 else
                   WeightsRef(version, str(runs[i]["weights"] / f"v{version}.safetensors")))
            table = heldout_rollouts(pc, heldout, ref, specs, cfg)
            order = np.argsort(table.column("prompt_id").to_numpy(zero_copy_only=False))
            out[key] = table.column("reward").to_numpy()[order]
    return out


def at_budget(mode: str, runs: list[dict], at: list[dict], rewards: dict) -> np.ndarray:
    """Per held-out prompt, the mean reward over ``mode``'s runs of the version each had at
    the budget."""
    return np.mean([rewards[i, at[i]["wall"][-1]] for i, r in enumerate(runs)
                    if r["mode"] == mode], axis=0)


def versus_sync(mode: str, runs: list[dict], at: list[dict], rewards: dict) -> dict:
    """Held-out accuracy at the budget minus sync's, and its standard error over the
    held-out prompts (paired: the same prompts for every run)."""
    diff = at_budget(mode, runs, at, rewards) - at_budget("sync", runs, at, rewards)
    return {"diff": round(float(diff.mean()), 4),
            "se": round(float(diff.std(ddof=1) / np.sqrt(len(diff))), 4)}


def summarize(mode: str, runs: list[dict], at: list[dict], accuracy: dict, walls: list[float],
              counts: list[int]) -> dict:
    """The mean over ``mode``'s runs of their numbers and accuracy curves."""
    mine = [i for i, r in enumerate(runs) if r["mode"] == mode]
    out = {key: round(mean(runs[i][key] for i in mine), 3) for key in (
        "samples_per_s", "iterations", "s_per_iteration", "generate_s_per_iteration",
        "update_s_per_iteration", "staleness_mean", "replayed_frac", "loadavg_1m",
        *DIAGNOSTICS)}
    out["samples_per_s_each_run"] = [round(runs[i]["samples_per_s"], 2) for i in mine]
    out["accuracy_at_budget_each_run"] = [round(float(accuracy[i, at[i]["wall"][-1]].mean()), 4)
                                          for i in mine]
    for kind, xs in (("wall", walls), ("samples", counts)):
        out[f"accuracy_vs_{kind}"] = [
            [round(x), round(float(mean(accuracy[i, at[i][kind][k]].mean() for i in mine)), 4)]
            for k, x in enumerate(xs)]
    return out


def amdahl_bound(mode: str, t: float, g: float, r: float) -> float:
    """The most ``mode`` could gain on sync's ``t`` seconds per iteration, ``g`` of them
    generating, with a share ``r`` of the samples replayed (module docstring)."""
    if mode == "async+replay":  # fill: the replayed rows come on top of a whole fresh batch
        return t / (1 - r) / max(g, (t - g) / (1 - r))
    left = (1 - r) * g  # generation still needed
    if mode == "async":
        return t / max(left, t - g)
    return t / (t - g + left)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-s", type=float, default=90.0)
    parser.add_argument("--repeats", type=int, choices=(1, 2), default=2)
    parser.add_argument("--gen-workers", type=int, default=1)
    parser.add_argument("--train-threads", type=int, default=1)
    parser.add_argument("--batch-prompts", type=int, default=32)
    parser.add_argument("--n-samples", type=int, default=8)
    parser.add_argument("--lr", type=float, default=Config.lr)
    parser.add_argument("--policy", choices=("static", "elastic"), default="static")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--replay-ratio", type=float, default=0.5)
    parser.add_argument("--replay-max-age", type=int, default=3)
    parser.add_argument("--tis-cap", type=float, default=Config.tis_cap)
    parser.add_argument("--replay-share", choices=("fixed", "adaptive"), default="adaptive")
    parser.add_argument("--replay-max-grad-share", type=float,
                        default=Config.replay_max_grad_share)
    parser.add_argument("--replay-age-decay", type=float, default=Config.replay_age_decay)
    parser.add_argument("--replay-max-skips", type=int, default=Config.replay_max_skips)
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, sync first (the baseline); also {LONGEST}")
    parser.add_argument("--heldout", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    ensure_tiny_model(log=lambda *_: None)  # build outside the timed runs
    started = time.time()
    chosen = tuple(args.modes.split(","))
    if chosen[0] != "sync" or not set(chosen) <= {*MODES, LONGEST}:
        parser.error(f"--modes: sync first, then any of {(*MODES[1:], LONGEST)}")
    order = [*chosen, *reversed(chosen)][: len(chosen) * args.repeats]
    with tempfile.TemporaryDirectory() as runs_dir:
        runs = [run_once(f"{mode.replace('+', '-')}-{i}", mode, args, runs_dir) | {"mode": mode}
                for i, mode in enumerate(order)]
        walls = [f * args.budget_s for f in FRACTIONS]
        counts = [int(f * min(r["samples"] for r in runs)) for f in FRACTIONS]
        at = [{"wall": [version_at(r["points"], "t", w) for w in walls],
               "samples": [version_at(r["points"], "samples", s) for s in counts]} for r in runs]
        wanted = {(0, 0)} | {(i, v) for i, a in enumerate(at) for vs in a.values() for v in vs}
        accuracy = accuracy_of(runs, wanted, args, runs_dir)
    modes = {mode: summarize(mode, runs, at, accuracy, walls, counts) for mode in chosen}
    sync = modes["sync"]
    t, g = sync["s_per_iteration"], sync["generate_s_per_iteration"]
    print(json.dumps({
        "bench": "modes", "budget_s": args.budget_s, "repeats": args.repeats,
        "policy": args.policy, "gen_workers": args.gen_workers,
        "train_threads": args.train_threads, "batch_prompts": args.batch_prompts,
        "n_samples": args.n_samples, "lr": args.lr, "max_staleness": args.max_staleness,
        "replay_ratio": args.replay_ratio, "replay_max_age": args.replay_max_age,
        "tis_cap": args.tis_cap, "replay_share": args.replay_share,
        "replay_max_grad_share": args.replay_max_grad_share,
        "replay_age_decay": args.replay_age_decay, "replay_max_skips": args.replay_max_skips,
        "heldout_prompts": args.heldout,
        "accuracy_at_start": float(accuracy[0, 0].mean()),
        "modes": modes,
        "throughput_ratio_vs_sync": {m: round(modes[m]["samples_per_s"] / sync["samples_per_s"],
                                              3) for m in chosen[1:]},
        "accuracy_at_budget_minus_sync": {m: versus_sync(m, runs, at, accuracy)
                                          for m in chosen[1:]},
        "amdahl_bound_vs_sync": {m: round(amdahl_bound(m, t, g, modes[m]["replayed_frac"]), 3)
                                 for m in chosen[1:] if m != LONGEST},
        "bench_s": round(time.time() - started),
    }))


if __name__ == "__main__":
    main()
