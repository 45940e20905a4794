"""The generation tail on a real LocalCluster: static vs recompute-migration vs KV-migration
vs split (the heaviest tail shed to the lightest worker) vs PAT reconfiguration, on the
long-tail setting of the embedded task.

For each model size (``--models``: the embedded ``tiny`` model and bench-size variants of it,
``ops/toy/benchmodel.py``), one pool of 2 generation workers x 1 torch thread:

1. warm both workers (model load outside the measurement) and measure the decode step
   profile reconfiguration decides from (``measure_step_profile``: 1 thread on both
   workers at once, 2 threads on one alone; a reconfiguration must pay by its medians and by each
   of its repeats);
2. run the same prompts (``LongTailTallyTask``: most lists 2-5 items, a tenth 18-24)
   under each tail mode of ``bench/tail_harness.py``, regrowing and warming the pool between
   modes; generation seconds and the pool's worker-seconds (from the cost ledger) and
   core-seconds; each checks every (prompt, sample) exactly once;
3. audit the transfer-vs-recompute choice: tails of several sizes are moved both ways
   (the choice is made first, from the models fitted so far); a choice is right when its
   path was the faster one measured.

With them, per model, the bounds: ``reconfig_bound`` (what consolidating even tails gains
per step by the profile's measured points, against the margin it must clear; the tail
batches whose consolidated batch lies beyond the largest measured one are listed) and
``latency_bound`` (the static run's decode by the measured step times, and the best
latency a perfect rebalancing or the longest response alone could give:
``tail_cost.latency_bound``).

``wide64`` (``wide``'s weights generated in float64, ``ops/toy/benchmodel.py`` BENCH_DTYPES) is
where a second thread pays on this machine; ``tiny`` (and ``wide``, float32) where it does
not. Prints one JSON line.
``python bench/tail.py [--models tiny,wide64] [--prompts 24] [--audit 6] [--modes static,...]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter

import numpy as np
import pyarrow as pa
import torch
from tail_harness import MODES, TailModels, run_tail
from transformers import AutoTokenizer

from rlhfless.ops.data.load import read_prompts
from rlhfless.ops.engine.backend import resolve_dtype
from rlhfless.ops.engine.engine_types import EngineSpec, SamplingParams, WeightsRef
from rlhfless.ops.engine.kv_transfer import kv_bytes_per_token
from rlhfless.ops.toy.benchmodel import BENCH_SIZES, bench_dtype, ensure_bench_model
from rlhfless.ops.toy.tinytask import LongTailTallyTask, make_splits
from rlhfless.pipeline.cluster.pools import Pool, PoolCluster
from rlhfless.pipeline.tasks.rollout import GenSpec, drop_task, generate_chunk_task, generate_task
from rlhfless.pipeline.tasks.tail import (
    adopt_tails_task,
    export_tail_task,
    move_actual_s,
)
from rlhfless.pipeline.train.step_profile import measure_step_profile
from rlhfless.schedulers.ledger import CostLedger
from rlhfless.schedulers.tail_cost import KvCosts, TransferModel, latency_bound
from rlhfless.schedulers.throughput import ThroughputModel

WORKERS = 2
# decode step profile: the live batches a tail runs at, dense where a step's cost bends (one
# sequence is a matrix-vector product, two already a matrix product); short prompts and few
# steps keep its measuring cheap (attention over a longer context costs little at these widths)
PROFILE_BATCHES = (1, 2, 4, 8, 16)
PROFILE_STEPS, PROFILE_PROMPT_TOKENS = 8, 8


def plain(value):
    """JSON for numpy scalars."""
    return value.item() if hasattr(value, "item") else str(value)


def warm(pc: PoolCluster, spec: GenSpec, weights: WeightsRef, shard: pa.Table) -> list[str]:
    """Grow the pool back to ``WORKERS`` and run a small generation on each (cold start)."""
    have = pc.worker_names("gen")
    if len(have) < WORKERS:
        pc.grow("gen", WORKERS - len(have))
    names = pc.worker_names("gen")
    futs = [pc.client.submit(generate_task, shard, weights, spec, 0,
                             workers=[pc.address_of(n)], pure=False) for n in names]
    pc.client.gather(futs)
    return names


def fit_length(table: pa.Table):
    """Response tokens as a linear function of prompt tokens, fitted on a static run."""
    x = np.array([len(p) for p in table.column("prompt_ids").to_pylist()], dtype=float)
    y = np.array([len(r) for r in table.column("response_ids").to_pylist()], dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    return lambda prompt_tokens: float(intercept + slope * prompt_tokens)


def reconfig_bound(profile) -> dict:
    """Where the profile says a reconfiguration of even tails pays before any move cost: per
    tail batch ``b`` on each worker, one worker with both threads decoding the
    ``WORKERS * b`` against each decoding its own, by the medians and by the least of the
    profile's repeats (``plan_reconfig`` fires only where every repeat agrees; uneven tails
    can pay at less). ``extrapolated``: the ``b`` whose ``WORKERS * b`` exceeds the largest
    batch measured on ``WORKERS`` threads."""
    gain = {b: round(profile.consolidation_speedup(b, WORKERS), 3) for b in PROFILE_BATCHES}
    least = {b: round(min(p.consolidation_speedup(b, WORKERS) for p in profile.repeats()), 3)
             for b in PROFILE_BATCHES}
    return {"consolidation_speedup": gain, "least_of_repeats": least,
            "pays": {b: min(gain[b], least[b]) > 1 for b in PROFILE_BATCHES},
            "extrapolated": [b for b in PROFILE_BATCHES
                             if WORKERS * b > profile.largest_batch(WORKERS)]}


def static_bound(profile, res: dict) -> dict:
    """``tail_cost.latency_bound`` of the static run's responses (by the worker that
    decoded them), and the latency gains against static it leaves, the rest (prefill,
    scheduling: measured minus modelled) kept: ``rebalance_gain``, the most any move
    between one-thread workers could give (decoding in ``balanced_s``), and ``chain_gain``,
    the most anything could (the longest response alone at its best thread count)."""
    table = res["rollouts"]
    lengths: dict[str, list[int]] = {}
    for w, r in zip(table.column("worker").to_pylist(), table.column("response_ids").to_pylist()):
        lengths.setdefault(w, []).append(len(r))
    bound = latency_bound(profile, lengths)
    rest = res["generation_s"] - bound["static_s"]
    gain = {f"{k}_gain": round(1 - (rest + bound[at]) / res["generation_s"], 3)
            for k, at in (("rebalance", "balanced_s"), ("chain", "chain_s"))}
    return {k: round(v, 3) for k, v in bound.items()} | gain | {
        "static_measured_s": round(res["generation_s"], 3)}


def audit(pc, names, prompts, spec, weights, models: TailModels, rounds: int) -> list[dict]:
    """Move tails of several sizes both ways; was the predicted-faster path the faster?"""
    c = pc.client
    src, dst = (pc.address_of(n) for n in names[:2])
    log = []
    for r in range(rounds):
        shard = prompts.slice(0, 2 + (r * 5) % max(3, len(prompts) - 2))
        key = f"audit-{r}"
        cut = c.submit(generate_chunk_task, shard, weights, spec, 100 + r, 0.3, key,
                       workers=[src], pure=False).result()["cut"]
        if len(cut) == 0:
            continue
        ctx = sum(len(p) + len(g) for p, g in zip(cut.column("prompt_ids").to_pylist(),
                                                  cut.column("partial_ids").to_pylist()))
        choice = models.kv.choose(ctx)
        redo = c.submit(adopt_tails_task, [], f"{key}-r", weights, spec, recompute=cut,
                        seed=100 + r, workers=[dst], pure=False).result()
        sent = c.submit(export_tail_task, key, workers=[src], pure=False)
        moved = c.submit(adopt_tails_task, [sent], f"{key}-t", weights, spec, workers=[dst],
                         pure=False).result()
        del sent
        for k in (f"{key}-r", f"{key}-t"):
            c.submit(drop_task, k, workers=[dst], pure=False).result()
        actual_t, actual_r = move_actual_s("transfer", moved), move_actual_s("recompute", redo)
        models.kv.observe("transfer", moved["context_tokens"], moved["bytes"], actual_t)
        models.kv.observe("recompute", redo["recompute_tokens"], 0, actual_r)
        best = "transfer" if actual_t <= actual_r else "recompute"
        log.append({"context_tokens": ctx, "bytes": moved["bytes"], "path": choice.path,
                    "predicted_transfer_s": choice.transfer_s,
                    "predicted_recompute_s": choice.recompute_s,
                    "actual_transfer_s": actual_t, "actual_recompute_s": actual_r,
                    "right": choice.path == best})
    return log


def bench_model(name: str, args, prompts_rows: list[dict]) -> dict:
    path = ensure_bench_model(name, log=lambda *_: None)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = read_prompts(pa.Table.from_pylist(prompts_rows), tok).table
    spec = GenSpec(EngineSpec(str(path), dtype=bench_dtype(name)), args.n_samples,
                   SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0))
    weights = WeightsRef(0, str(path))
    shards = [prompts.take(list(range(i, len(prompts), WORKERS))) for i in range(WORKERS)]
    ledger = CostLedger({"gen": 1.0})
    itemsize = resolve_dtype(bench_dtype(name), torch.device("cpu")).itemsize
    out: dict = {"model": name, "dtype": bench_dtype(name),
                 "kv_bytes_per_token": kv_bytes_per_token(path, itemsize)}
    with PoolCluster([Pool("gen", WORKERS, 1, {"GEN": 1}, "4GiB")], ledger) as pc:
        names = warm(pc, spec, weights, prompts.slice(0, 1))
        profile = measure_step_profile(pc, names, spec, weights, PROFILE_BATCHES, PROFILE_STEPS,
                                  prompt_tokens=PROFILE_PROMPT_TOKENS)
        models = TailModels(KvCosts(ThroughputModel(), TransferModel(),
                                    out["kv_bytes_per_token"]), profile)
        out["profile"] = profile.to_record()
        out["thread_speedup"] = {b: round(profile.speedup(b, 2), 3) for b in PROFILE_BATCHES}
        out["reconfig_bound"] = reconfig_bound(profile)
        # prime the cost models with two moves of this run (as a live run's first tails)
        out["audit_warmup"] = audit(pc, names, prompts, spec, weights, models, 2)
        predict_len = None
        for mode in args.modes:
            names = warm(pc, spec, weights, prompts.slice(0, 1))
            res = run_tail(pc, names, shards, spec, weights, mode, args.tau, models,
                           predict_len or (lambda n: float(args.max_new_tokens)), mode)
            pairs = Counter(zip(res["rollouts"].column("prompt_id").to_pylist(),
                                res["rollouts"].column("sample_idx").to_pylist()))
            lengths = [len(r) for r in res["rollouts"].column("response_ids").to_pylist()]
            if mode == "static":
                predict_len = fit_length(res["rollouts"])
                out["response_tokens"] = {"median": statistics.median(lengths),
                                          "max": max(lengths)}
                out["latency_bound"] = static_bound(profile, res)
            out[mode] = {"generation_s": round(res["generation_s"], 3),
                         "worker_s": round(res["worker_s"], 3), "core_s": round(res["core_s"], 3),
                         "exactly_once": len(pairs) == len(prompts) * args.n_samples
                         and set(pairs.values()) == {1},
                         "decision": res["decision"]}
        names = warm(pc, spec, weights, prompts.slice(0, 1))
        checks = audit(pc, names, prompts, spec, weights, models, args.audit)
    static, others = out["static"], [m for m in args.modes if m != "static"]
    for mode in others:
        for key in ("generation_s", "worker_s", "core_s"):
            out[mode][f"{key}_vs_static"] = round(out[mode][key] / static[key], 3)
    out["latency_bound"]["measured_vs_static"] = {
        mode: out[mode]["generation_s_vs_static"] for mode in others}
    out["fired"] = {mode: bool(out[mode]["decision"].get(mode, {}).get("fire"))
                    for mode in ("split", "reconfig") if mode in out}
    moves = [m for mode in args.modes for m in out[mode]["decision"].get("moves", [])]
    out["moves"] = len(moves)
    out["choice_audit"] = {"moves": len(checks), "right": sum(c["right"] for c in checks),
                           "log": checks}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,wide64")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--n-samples", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--tau", type=float, default=0.6)
    ap.add_argument("--audit", type=int, default=6)
    ap.add_argument("--modes", default=",".join(MODES),
                    help="tail modes to run, static first (the others' baseline)")
    args = ap.parse_args()
    args.modes = args.modes.split(",")
    if args.modes[0] != "static" or set(args.modes) - set(MODES):
        ap.error(f"--modes: {','.join(args.modes)}; allowed: static first, then any of "
                 f"{', '.join(MODES[1:])}")
    unknown = set(args.models.split(",")) - {"tiny", *BENCH_SIZES}
    if unknown:
        ap.error(f"--models: {', '.join(sorted(unknown))}; allowed: tiny, {', '.join(BENCH_SIZES)}")
    task = LongTailTallyTask(n_train=args.prompts, n_heldout=1, n_sft=0)
    rows = make_splits(task, seed=1)["train"]
    started = time.time()
    load_before = os.getloadavg()
    results = []
    for name in args.models.split(","):
        results.append(bench_model(name, args, rows))
        print(json.dumps(results[-1], default=plain), file=sys.stderr, flush=True)
    print(json.dumps({"bench": "tail", "workers": WORKERS, "threads_at_start": 1,
                      "prompts": args.prompts, "n_samples": args.n_samples, "tau": args.tau,
                      "models": results, "seconds": round(time.time() - started, 1),
                      "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
                     default=plain))


if __name__ == "__main__":
    main()
