"""Stability over seeds: seeds x modes x a horizon, one invocation.

Each run trains the embedded tiny model with every key at its default except ``mode``,
``seed`` and ``iterations`` (and ``--set`` overrides, for ablations), evaluating the held-out
prompts every ``--eval-every`` iterations. Per run it prints the held-out curve, its peak, its
end, the largest drop from a peak (``max_drop``), the response length's growth (mean length
of the last iteration over the first), whether the run collapsed: it ends more than
``--collapse-drop`` (0.1) below its peak, and what the online collapse guard said
(``guard``: its ``collapse`` records; with the default ``on_collapse = "rollback"`` the run
went back to its last good checkpoint, and the curve is what it kept; ``--set
on_collapse=warn`` leaves runs alone, to compare the guard's verdicts with the curve's).
Per mode: the collapse rate, the final held-out accuracy's mean and standard deviation over
seeds, and samples/s (samples trained per second from the first iteration's start to the
last one's end, mean and standard deviation; the held-out evaluations in between are
included, and so is the time of iterations a rollback undid, so compare modes at the same
``--eval-every``), and ``train_samples_per_s``: the same samples over the seconds of the
iterations the run kept (``iteration_s`` summed: no evaluation, no undone iteration).

Runs go seed-major (every mode of seed 0, then of seed 1, ...), so a drift in the machine's
load weighs on every mode alike. Prints one JSON line; each run's line goes to stderr as it
ends.

    python bench/stability.py [--seeds 0,1,2,3,4] [--modes sync,async,replay,async+replay]
                              [--iterations 80] [--eval-every 5] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from statistics import mean, pstdev

from rlhfless.pipeline.config import load_config
from rlhfless.pipeline.train.loop import train


def curve_facts(curve: list[tuple[int, float]], collapse_drop: float) -> dict:
    """Peak, end, the largest drop from a running peak, and the collapse verdict."""
    peak, drop = float("-inf"), 0.0
    for _, acc in curve:
        peak = max(peak, acc)
        drop = max(drop, peak - acc)
    end = curve[-1][1]
    return {"peak": peak, "end": end, "max_drop": drop, "collapsed": peak - end > collapse_drop}


def one_run(cfg, collapse_drop: float) -> dict:
    run = train(cfg, progress=False, log=lambda _line: None)
    records = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    iters = [r for r in records if r.get("event") == "iteration"]
    curve = [(r["iteration"], r["heldout_accuracy"]) for r in records
             if "heldout_accuracy" in r]
    lengths = [r["response_len_mean"] for r in iters if "response_len_mean" in r]
    guard = [{k: r[k] for k in ("iteration", "detected_at", "signal", "best", "now", "action")
              if k in r} for r in records if r.get("event") == "collapse"]
    samples = sum(r.get("samples", 0) for r in iters)
    seconds = iters[-1]["time"] - iters[0]["time"] + iters[0].get("iteration_s", 0.0)
    train_s = sum(r.get("iteration_s", 0.0) for r in iters)
    return {"mode": cfg.mode, "seed": cfg.seed, "curve": curve,
            **curve_facts(curve, collapse_drop),
            "length_growth": lengths[-1] / lengths[0] if lengths and lengths[0] else None,
            "samples_per_s": samples / seconds if seconds > 0 else None,
            "train_samples_per_s": samples / train_s if train_s > 0 else None, "guard": guard}


def summarise(runs: list[dict]) -> dict:
    out = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        mine = [r for r in runs if r["mode"] == mode]
        ends = [r["end"] for r in mine]
        rates = [r["samples_per_s"] for r in mine if r["samples_per_s"]]
        train_rates = [r["train_samples_per_s"] for r in mine if r["train_samples_per_s"]]
        out[mode] = {"runs": len(mine), "collapse_rate": mean(r["collapsed"] for r in mine),
                     "guard_flagged_rate": mean(bool(r["guard"]) for r in mine),
                     "end_mean": mean(ends), "end_std": pstdev(ends),
                     "peak_mean": mean(r["peak"] for r in mine),
                     "samples_per_s_mean": mean(rates) if rates else None,
                     "samples_per_s_std": pstdev(rates) if rates else None,
                     "train_samples_per_s_mean": mean(train_rates) if train_rates else None,
                     "train_samples_per_s_std": pstdev(train_rates) if train_rates else None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--modes", default="sync,async,replay,async+replay")
    ap.add_argument("--iterations", type=int, default=80)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--collapse-drop", type=float, default=0.1)
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="KEY=VALUE", help="a config override for every run (ablations)")
    args = ap.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="rlhfless-stability-") as tmp:
        base = load_config(overrides=[f"runs_dir={tmp}", f"iterations={args.iterations}",
                                      f"eval_every={args.eval_every}", *args.overrides])
        for seed in (int(s) for s in args.seeds.split(",")):
            for mode in args.modes.split(","):
                cfg = replace(base, name=f"{mode.replace('+', '-')}-{seed}", mode=mode,
                              seed=seed)
                runs.append(one_run(cfg, args.collapse_drop))
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)  # kept if stopped
    print(json.dumps({"iterations": args.iterations, "overrides": args.overrides,
                      "load_avg": os.getloadavg(), "modes": summarise(runs), "runs": runs}))


if __name__ == "__main__":
    main()
