"""The long tail through the training loop's own generation: elastic against a static pool.

Each round generates the same batch of long-tail prompts (``LongTailTallyTask``) on two
one-thread generation workers twice, in alternating order:

- ``static``: each worker decodes its shard to the end (``generate_task``), the pool billed
  until the last one ends;
- ``elastic``: ``ElasticGeneration.run_generation``, the code a run with ``policy =
  "elastic"`` generates with (``gen_min_workers = 2``, ``lambda_cost = 1``): the pool
  paused at ``tau``, the policy's tail decision from the step profile the loop measured on
  the pool at its first round, applied; its worker-seconds from the ledger.

Round 0 warms up both (the profile, the predictor's lengths); the policy learns after every
round as a run's does (``bookkeeping.observe_iteration``). Prints one JSON line: per round
each side's generation seconds and worker-seconds, the tail decision (action, predicted and
actual seconds), and the medians of elastic / static over the measured rounds.
``python bench/tail_loop.py [--model wide64] [--prompts 24] [--rounds 4]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
from transformers import AutoTokenizer

from rlhfless.ops.data.load import read_prompts
from rlhfless.ops.engine.engine_types import WeightsRef
from rlhfless.ops.engine.gen_stats import Generated
from rlhfless.ops.engine.seeds import generation_seed
from rlhfless.ops.toy.benchmodel import bench_dtype, ensure_bench_model
from rlhfless.ops.toy.tinytask import LongTailTallyTask, make_splits
from rlhfless.pipeline.cluster.pools import Pool, PoolCluster
from rlhfless.pipeline.config import Config
from rlhfless.pipeline.durable.runs import RunDir
from rlhfless.pipeline.report.bookkeeping import observe_iteration
from rlhfless.pipeline.specs import make_specs
from rlhfless.pipeline.tasks.rollout import generate_task
from rlhfless.pipeline.train.elastic import ElasticGeneration
from rlhfless.schedulers.ledger import CostLedger
from rlhfless.schedulers.scaling_policy import ScalingPolicy

WORKERS = 2


def full_pool(pc: PoolCluster, shard: pa.Table, weights, specs) -> None:
    """Back to ``WORKERS`` warm generation workers (a released one restarted and its
    model loaded), outside any measurement."""
    missing = WORKERS - len(pc.worker_names("gen"))
    if missing > 0:
        new = pc.grow("gen", missing)
        pc.client.gather([pc.client.submit(generate_task, shard, weights, specs.gen, 0,
                                           workers=[pc.address_of(n)], pure=False)
                          for n in new])


def static_round(pc: PoolCluster, shards: list[pa.Table], weights, specs, seed: int) -> dict:
    """Each worker decodes its shard whole; the pool is billed until the last one ends."""
    names = pc.worker_names("gen")
    started = time.time()
    futs = [pc.client.submit(generate_task, s, weights, specs.gen, seed,
                             workers=[pc.address_of(n)], pure=False)
            for s, n in zip(shards, names)]
    out = Generated.concat(pc.client.gather(futs))
    ended = max(out.table.column("gen_end").to_pylist())
    return {"generation_s": ended - started, "worker_s": WORKERS * (ended - started),
            "sequences": len(out)}


def elastic_round(eg: ElasticGeneration, pc: PoolCluster, batch: pa.Table, weights, specs,
                  iteration: int, scaling: ScalingPolicy) -> dict:
    """The training loop's elastic generation of ``batch``; the policy then learns from it."""
    pc.sync_events()
    started = time.time()
    _, trainables, facts = eg.run_generation(batch, weights, iteration, specs, seed=0)
    out = Generated.concat(pc.client.gather(trainables))
    ended = max(out.table.column("gen_end").to_pylist())
    pc.sync_events()
    worker_s = (pc.ledger.worker_seconds("gen", until=ended)
                - pc.ledger.worker_seconds("gen", until=started))
    observe_iteration(scaling, out.table, eg.after_update(0.0, [out.stats]))
    tails = [d for d in eg.run.read_jsonl("decisions.jsonl")
             if d["kind"] == "tail" and d["iteration"] == iteration]
    return {"generation_s": ended - started, "worker_s": worker_s, "sequences": len(out),
            "migrated": facts["migrated_sequences"],
            "tail": [{k: t.get(k) for k in ("action", "predicted_stay_s", "predicted_s",
                                            "actual_s", "reason")} for t in tails]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="wide64")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=4, help="measured rounds after round 0")
    ap.add_argument("--tau", type=float, default=0.6)
    args = ap.parse_args()
    path = ensure_bench_model(args.model, log=lambda *_: None)
    rows = make_splits(LongTailTallyTask(n_sft=0), 11)["train"][: args.prompts]
    tok = AutoTokenizer.from_pretrained(path)
    batch = read_prompts(pa.Table.from_pylist(rows), tok).table
    shards = [batch.take(list(range(i, len(batch), WORKERS))) for i in range(WORKERS)]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Config(model=str(path), runs_dir=tmp, name="tail-loop", n_samples=2,
                     max_new_tokens=64, batch_prompts=args.prompts, policy="elastic",
                     gen_workers=WORKERS, gen_min_workers=WORKERS, lambda_cost=1.0,
                     tau=args.tau, gen_dtype=bench_dtype(args.model), train_threads=1)
        run = RunDir.create(cfg)
        specs = make_specs(cfg, Path(path), run)
        weights = WeightsRef(0, str(path))
        scaling = ScalingPolicy(cfg.scaling_knobs())
        pools = [Pool("gen", WORKERS, 1, {"GEN": 1}, "4GiB"),
                 Pool("train", 1, 1, {"TRAIN": 1}, "2GiB")]
        rounds = []
        with PoolCluster(pools, CostLedger({"gen": 1.0, "train": 1.0})) as pc:
            eg = ElasticGeneration(pc, cfg, run, scaling)
            for r in range(args.rounds + 1):
                sides = ("static", "elastic") if r % 2 == 0 else ("elastic", "static")
                row = {"round": r}
                for side in sides:
                    full_pool(pc, batch.slice(0, 1), weights, specs)
                    row[side] = (static_round(pc, shards, weights, specs,
                                              generation_seed(0, r + 1)) if side == "static"
                                 else elastic_round(eg, pc, batch, weights, specs, r + 1,
                                                    scaling))
                rounds.append(row)
                print(json.dumps(row), file=sys.stderr)
        profile = next((d for d in run.read_jsonl("decisions.jsonl")
                        if d["kind"] == "step_profile"), None)
        run.release()
    measured = rounds[1:]
    ratio = {k: round(statistics.median(r["elastic"][k] / r["static"][k] for r in measured), 3)
             for k in ("generation_s", "worker_s")} if measured else {}
    print(json.dumps({"model": args.model, "prompts": args.prompts, "tau": args.tau,
                      "load_before": load_before, "load_after": os.getloadavg()[0],
                      "elastic_over_static_median": ratio, "rounds": rounds,
                      "step_profile_s": profile and profile["seconds"]}))


if __name__ == "__main__":
    main()
