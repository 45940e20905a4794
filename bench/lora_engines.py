"""LoRA learning on vLLM against LoRA on our engine: the same run, two generation backends.

Each run trains the embedded tiny model with every key at its default except
``lora_rank`` / ``lora_alpha`` / ``lr`` (the adapters train alone, so they take a larger
step than full weights) and ``backend`` (``--set`` overrides apply to both), evaluating the
held-out prompts every ``--eval-every`` iterations. Per backend it prints the held-out
curve, its start and end, the gain (end - start), the run's wall seconds and the bytes each
version was published as (least and most of ``weights_bytes``); then whether the two ends
are within ``--end-within`` (0.05) and each gained at least ``--min-gain`` (0.15). Backends
run one after the other, ``hf`` first. Prints one JSON line.

    python bench/lora_engines.py [--iterations 30] [--lora-rank 8] [--lr 5e-3]
                                 [--eval-every 5] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from rlhfless.pipeline.config import load_config
from rlhfless.pipeline.train.loop import train

BACKENDS = ("hf", "vllm")


def one_run(overrides: list[str]) -> dict:
    started = time.perf_counter()
    run = train(load_config(overrides=overrides), progress=False, log=lambda _line: None)
    records = run.metrics()
    curve = [(r["iteration"], r["heldout_accuracy"]) for r in records if "heldout_accuracy" in r]
    published = [r["weights_bytes"] for r in records if r.get("event") == "iteration"]
    return {"curve": curve, "start": curve[0][1], "end": curve[-1][1],
            "gain": curve[-1][1] - curve[0][1], "seconds": time.perf_counter() - started,
            "weights_bytes_per_version": [min(published), max(published)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--end-within", type=float, default=0.05)
    ap.add_argument("--min-gain", type=float, default=0.15)
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="KEY=VALUE", help="a config override for both runs")
    args = ap.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory(prefix="rlhfless-lora-") as tmp:
        common = [f"runs_dir={tmp}", f"iterations={args.iterations}",
                  f"eval_every={args.eval_every}", f"lora_rank={args.lora_rank}",
                  f"lora_alpha={2.0 * args.lora_rank}", f"lr={args.lr}", *args.overrides]
        for backend in BACKENDS:
            runs[backend] = one_run([*common, f"backend={backend}", f"name=lora-{backend}"])
    gap = abs(runs["hf"]["end"] - runs["vllm"]["end"])
    print(json.dumps({"iterations": args.iterations, "lora_rank": args.lora_rank, "lr": args.lr,
                      "overrides": args.overrides, "load_avg": os.getloadavg(),
                      "end_gap": gap, "ends_within": gap <= args.end_within,
                      "both_gained": all(r["gain"] >= args.min_gain for r in runs.values()),
                      "runs": runs}))


if __name__ == "__main__":
    main()
