"""FSDP2's peak memory per trainer rank at a real model's size, held against the bytes each
rank must hold, beside one unsharded rank in the same invocation.

The model is ``bench/weights.py``'s (Qwen2.5-0.5B dims by default, ``--dims 1.5b``, or
``--dims tiny`` to check the script in seconds; random weights, fp32, built here). The
trainer is the project's own: a ``TrainSpec`` as a run builds it (``EngineSpec(model,
"cpu", --threads)``, ``UpdateParams`` at the run's defaults: no KL reference, micro-batches
of 8,192 tokens, one epoch), loaded on each worker by
``start_trainer_task`` (with ranks: ``wrap_model``'s FSDP2 ``fully_shard`` on every decoder
layer and the root, the tied embeddings in the root's unit; AdamW over the shards), then each
update through ``update_task`` on the first rank, which fans out to the others as a run's does
(``on_ranks``; each rank runs its share of the groups, gradients reduce-scattered): forward,
backward and AdamW's step on one short batch (``bench/trainer.py``'s synthetic batch,
``--prompts`` groups of ``--samples`` rows), ``--updates`` times (default 2: AdamW makes its
moments in the first step, so only from the second update on does the forward and backward
run beside them, as every update of a run but its first does). Each variant gets a
``LocalCluster`` of its own (``--ranks`` worker processes started as a run starts them:
``PoolNanny``, its malloc settings, one rank per process, gloo over loopback), so every
process's peak is its own.

Per rank:

* ``peak_rss_update_bytes``: the process's resident set at its highest during the last
  update (Linux ``VmHWM``, reset through ``/proc/self/clear_refs`` once the trainer is
  loaded and after each optimizer step): everything the process holds, the interpreter,
  torch, Dask and the page-cache pages it maps included. ``updates`` has each update's,
  split at the optimizer's step (its ``step`` wrapped on the instance to read and reset the
  peak): ``peak_rss_to_step_bytes`` (forward, backward, gradient clipping) and
  ``peak_rss_step_bytes`` (AdamW's step). ``rss_before_load_bytes``:
  its resident set before the trainer was loaded (that process's floor);
  ``peak_rss_load_bytes``: the highest while the trainer loaded (``from_pretrained``, then
  the sharding).
* ``bound_bytes``: the bytes the rank must hold at least through an update: its shard of
  every parameter (a DTensor's local rows; one rank: the whole tensor), once each for the
  parameter, its gradient and AdamW's two moments (``exp_avg``, ``exp_avg_sq``), each at the
  parameter's dtype (fp32 here): 4 × the shard's bytes. Not counted: AdamW's ``step`` (a
  scalar per parameter), activations, logits, the units FSDP2 gathers for each pass and its
  communication buffers, which an update needs too but a different schedule could shrink.
  ``optimizer_state_bytes`` (read from the optimizer after the step) checks the moments' part.
* ``peak_over_bound`` = ``peak_rss_update_bytes`` / ``bound_bytes``, and
  ``peak_above_floor_over_bound`` = (``peak_rss_update_bytes`` - ``rss_before_load_bytes``)
  / ``bound_bytes`` (the process's own floor left out).

Prints one JSON line.

    python bench/fsdp_memory.py [--dims 0.5b|1.5b] [--ranks 2] [--prompts 4] [--samples 4]
                                [--updates 2] [--threads 1] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import torch
from distributed import Client, LocalCluster
from trainer import synthetic_batch
from weights import DIMS, build_model_dir

from rlhfless.ops.algo.parallel import local_part
from rlhfless.ops.algo.update import UpdateParams
from rlhfless.ops.engine.engine_types import EngineSpec, WeightsRef
from rlhfless.ops.engine.gen_stats import Generated
from rlhfless.pipeline.cluster.deploy import WORKER_ENV, PoolNanny
from rlhfless.pipeline.tasks.ranks import form_group, on_ranks, store_dir
from rlhfless.pipeline.tasks.trainer import (
    TrainSpec,
    _trainer,
    leave_trainer_task,
    start_trainer_task,
    update_task,
)

TINY = {**DIMS["0.5b"], "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 4096}
SIZES = {**DIMS, "tiny": TINY}  # tiny: a seconds-long check of the script itself


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := the resident set now


def load_rank(spec: TrainSpec) -> dict:
    """On a rank: its trainer loaded (sharded with ranks); its memory before and while, then
    its peak reset so that the update's is its own."""
    before = psutil.Process().memory_info().rss
    started = time.perf_counter()
    start_trainer_task(spec, 0, "bench")
    load_s = time.perf_counter() - started
    load_peak = _status_kib("VmHWM") * 1024
    trainer = _trainer(spec)
    phases = trainer.bench_phases = []  # one per update, read back by read_rank
    step = trainer.optimizer.step

    def timed_step(*args, **kwargs):  # the peak up to the step, then the step's own
        to_step = _status_kib("VmHWM") * 1024
        _reset_peak()
        out = step(*args, **kwargs)
        in_step = _status_kib("VmHWM") * 1024
        _reset_peak()
        phases.append({"peak_rss_to_step_bytes": to_step, "peak_rss_step_bytes": in_step,
                       "peak_rss_bytes": max(to_step, in_step)})
        return out

    trainer.optimizer.step = timed_step
    _reset_peak()
    return {"rss_before_load_bytes": before, "peak_rss_load_bytes": load_peak,
            "rss_after_load_bytes": psutil.Process().memory_info().rss,
            "load_s": round(load_s, 2)}


def read_rank(spec: TrainSpec) -> dict:
    """On a rank after the update: its peak resident set since ``load_rank`` and the bytes
    it must hold (the module docstring's bound)."""
    trainer = _trainer(spec)  # the one load_rank loaded
    shards = [local_part(p) for p in trainer.model.parameters()]
    shard_bytes = sum(t.numel() * t.element_size() for t in shards)
    states = [t for s in trainer.optimizer.state.values() for t in s.values()
              if torch.is_tensor(t) and t.dim()]
    info = psutil.Process().memory_full_info()
    phases = trainer.bench_phases
    return {"peak_rss_update_bytes": phases[-1]["peak_rss_bytes"], "updates": phases,
            "rss_after_update_bytes": info.rss,
            "param_shard_elements": sum(t.numel() for t in shards),
            "param_shard_bytes": shard_bytes, "bound_bytes": 4 * shard_bytes,
            "optimizer_state_bytes": sum(local_part(t).numel() * local_part(t).element_size()
                                         for t in states),
            "dtypes": sorted({str(t.dtype) for t in shards})}


def variant(model: Path, batch, world: int, threads: int, updates: int, where: Path
            ) -> dict:
    """``updates`` updates of the trainer on ``world`` ranks (FSDP2 when more than one), each rank a
    worker process of a new ``LocalCluster``."""
    spec = TrainSpec(EngineSpec(str(model), "cpu", threads), UpdateParams(), None,
                     world=world, parallel="fsdp")
    cluster = LocalCluster(n_workers=0, processes=True, host="127.0.0.1",
                           dashboard_address=None, silence_logs=logging.WARNING)
    with cluster, Client(cluster) as client:
        for i in range(world):  # as a run's local deployment starts its trainer workers
            cluster.worker_spec[f"train-{i}"] = {"cls": PoolNanny, "options": {
                "host": "127.0.0.1", "nthreads": 1, "memory_limit": 0,
                "silence_logs": logging.WARNING,
                "env": {"OMP_NUM_THREADS": str(threads), **WORKER_ENV}}}
        cluster.scale(world)
        client.wait_for_workers(world)
        members = sorted(client.scheduler_info()["workers"])
        if world > 1:
            form_group(client, members, members, "cpu", "fsdp", leave_trainer_task,
                       store_dir(where))
        loaded = on_ranks(load_rank, spec, client=client, members=members)
        seconds, losses = [], []
        for _ in range(updates):  # the trainer stays at v0: nothing is published
            started = time.perf_counter()
            metrics = client.submit(update_task, [Generated(batch)], WeightsRef(0, str(model)),
                                    spec, workers=[members[0]], allow_other_workers=False,
                                    pure=False).result()
            seconds.append(round(time.perf_counter() - started, 2))
            losses.append(metrics.get("loss"))
        after = on_ranks(read_rank, spec, client=client, members=members)
    ranks = []
    for r, (a, b) in enumerate(zip(loaded, after)):
        row = {"rank": r, **a, **b}
        row["peak_over_bound"] = round(row["peak_rss_update_bytes"] / row["bound_bytes"], 3)
        row["peak_above_floor_over_bound"] = round(
            (row["peak_rss_update_bytes"] - row["rss_before_load_bytes"]) / row["bound_bytes"], 3)
        ranks.append(row)
    return {"ranks": world, "parallel": "fsdp" if world > 1 else "none",
            "update_s": seconds, "forward_tokens": metrics.get("forward_tokens"),
            "loss": losses, "per_rank": ranks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", choices=sorted(SIZES), default="0.5b", help="Qwen2.5 size")
    ap.add_argument("--ranks", type=int, default=2, help="FSDP2 ranks (beside 1 unsharded)")
    ap.add_argument("--prompts", type=int, default=4, help="groups in the batch")
    ap.add_argument("--samples", type=int, default=4, help="rows per group")
    ap.add_argument("--max-response", type=int, default=40)
    ap.add_argument("--updates", type=int, default=2, help="the peak is the last one's")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--dir", default=None, help="where the model goes")
    args = ap.parse_args()
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="rlhfless-fsdp-", dir=args.dir) as tmp:
        tmp = Path(tmp)
        model, params, nbytes = build_model_dir(tmp / "model", SIZES[args.dims])
        batch = synthetic_batch(args.prompts, args.samples, args.max_response)
        variants = {f"{w}_rank{'s' if w > 1 else ''}": variant(model, batch, w, args.threads,
                                                              args.updates, tmp)
                    for w in (1, args.ranks)}
    one, sharded = variants["1_rank"], variants[f"{args.ranks}_ranks"]
    worst = max(sharded["per_rank"], key=lambda r: r["peak_rss_update_bytes"])
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=Path(__file__).parent).stdout.strip()
    print(json.dumps({
        "bench": "fsdp_memory", "model": f"Qwen2.5-{args.dims.upper()} dims, random init, fp32",
        "params": params, "model_bytes": nbytes, "batch_rows": batch.num_rows,
        "threads_per_rank": args.threads, "updates": args.updates, "variants": variants,
        "summary": {
            "fsdp_peak_rss_per_rank_bytes": worst["peak_rss_update_bytes"],
            "fsdp_bound_per_rank_bytes": worst["bound_bytes"],
            "fsdp_peak_over_bound": worst["peak_over_bound"],
            "fsdp_peak_above_floor_over_bound": worst["peak_above_floor_over_bound"],
            "one_rank_peak_rss_bytes": one["per_rank"][0]["peak_rss_update_bytes"],
            "one_rank_bound_bytes": one["per_rank"][0]["bound_bytes"],
            "one_rank_peak_over_bound": one["per_rank"][0]["peak_over_bound"],
            "fsdp_peak_over_one_rank_peak": round(
                worst["peak_rss_update_bytes"] / one["per_rank"][0]["peak_rss_update_bytes"], 3)},
        "commit": head, "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
        "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
