"""The cost of Dask's default malloc settings to torch on CPU workers, and ours.

Two one-worker LocalClusters side by side: one with Dask's plain ``Nanny`` (which exports
``MALLOC_TRIM_THRESHOLD_=65536`` to its worker and so freezes glibc's mmap threshold at
128 KiB), one with ``deploy.PoolNanny`` (``MALLOC_ENV``). Each worker generates a batch of
the embedded tiny model (``--prompts`` × ``--samples``, 1 torch thread) and runs
``--repeats`` policy updates on it, alternating between the clusters; the median seconds of
each stage are printed as one JSON line with the ratio dask default / ours.

    python bench/worker_malloc.py [--prompts 32] [--samples 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

from distributed import Client, LocalCluster, Nanny

from rlhfless.ops.toy.tinymodel import ensure_tiny_model
from rlhfless.pipeline.cluster.deploy import MALLOC_ENV, PoolNanny


def stage_seconds(model_path: str, prompts: int, samples: int) -> dict:
    """Seconds of one generation and one update of the tiny model, in this process."""
    import os

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhfless.ops.algo.advantage import compute_advantages
    from rlhfless.ops.algo.update import UpdateParams, update_policy
    from rlhfless.ops.data.load import read_prompts
    from rlhfless.ops.engine.engine_types import SamplingParams
    from rlhfless.ops.engine.generate import generate_rollouts
    from rlhfless.ops.rollouts.reward import score

    torch.set_num_threads(1)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    table = read_prompts(f"{model_path}/train.jsonl", tok).table.slice(0, prompts)
    started = time.perf_counter()
    rollouts, _ = generate_rollouts(model, tok, table, samples,
                                    SamplingParams(max_new_tokens=64), policy_version=0)
    generate_s = time.perf_counter() - started
    batch = compute_advantages(score(rollouts), "grpo", n_samples=samples)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    started = time.perf_counter()
    update_policy(model, optimizer, batch, UpdateParams(), tok.pad_token_id)
    return {"generate_s": generate_s, "update_s": time.perf_counter() - started,
            "malloc_env": {k: os.environ.get(k) for k in
                           ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")}}


def one_worker_cluster(nanny: type) -> LocalCluster:
    cluster = LocalCluster(n_workers=0, processes=True, silence_logs=logging.WARNING,
                           dashboard_address=":0")
    cluster.worker_spec["w"] = {"cls": nanny, "options": {"nthreads": 1}}
    cluster.scale(1)
    return cluster


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    path = str(ensure_tiny_model(log=lambda *_: None))
    variants = {"dask_default": Nanny, "ours": PoolNanny}
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    clusters, clients = {}, {}
    try:
        # one after the other: a nanny leaks its pre-spawn environment into this process
        for name, nanny in variants.items():
            clusters[name] = one_worker_cluster(nanny)
            clients[name] = Client(clusters[name])
            clients[name].wait_for_workers(1)
        for _ in range(args.repeats):
            for name, client in clients.items():
                runs[name].append(client.submit(stage_seconds, path, args.prompts,
                                                args.samples, pure=False).result())
    finally:
        for closable in [*clients.values(), *clusters.values()]:
            closable.close()
    out = {name: {stage: round(statistics.median(r[stage] for r in rs), 3)
                  for stage in ("generate_s", "update_s")} | {"malloc_env": rs[0]["malloc_env"]}
           for name, rs in runs.items()}
    print(json.dumps({
        "bench": "worker_malloc", "prompts": args.prompts, "samples": args.samples,
        "repeats": args.repeats, "ours_env": MALLOC_ENV, **out,
        "slowdown_of_dask_default": {
            stage: round(out["dask_default"][stage] / out["ours"][stage], 2)
            for stage in ("generate_s", "update_s")},
    }))


if __name__ == "__main__":
    main()
