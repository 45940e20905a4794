"""Weights at a real model's size: each version's publish and fetch seconds, held against
this machine's own bounds measured in the same invocation.

The model is Qwen2.5-0.5B-shaped (its published config: hidden 896, 24 layers, 14 query and
2 KV heads, MLP 4864, vocabulary 151,936, tied embeddings; 494M parameters), random weights
built here, saved once as a model directory (the embedded tiny model's tokenizer, built
without its model, beside them: nothing is generated). A real LocalCluster of two worker
processes runs the real tasks: the trainer's ``publish_task`` on one, and on the other
``generation_engine`` (our ``hf`` engine: its cold start is the base load, then each
version's fetch and load into the engine). For each weight store (``run``: files in the
run directory; ``cluster``: held by the trainer, fetched worker to worker over Dask's comms)
and each kind of version (the full weights; a rank-16 LoRA adapter on q, k, v, o), it
times ``--versions`` versions and keeps the fastest.

The bounds, on the same bytes (the model's): memory copy (one tensor copied into another),
file write and file read into memory already allocated (the store's file system, through
the page cache as the publish's own write and the fetch's read go). Ratios: a version's
bytes per second over the bound (publish: over the write bound; fetch: over the read
bound). Prints one JSON line.

    python bench/weights.py [--versions 2] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from distributed import Client, LocalCluster
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlhfless.ops.algo.update import UpdateParams
from rlhfless.ops.engine.engine_types import EngineSpec, WeightsRef
from rlhfless.ops.engine.lora import LoraSpec
from rlhfless.ops.toy.tinymodel import TinyRecipe, build_tokenizer
from rlhfless.pipeline.tasks.rollout import generation_engine
from rlhfless.pipeline.tasks.trainer import TrainSpec, drop_trainer, publish_task

QWEN25_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
              "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
              "max_position_embeddings": 32768, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": True}
ADAPTER = LoraSpec(rank=16, alpha=32.0)
GB = 1e9


def build_model_dir(out: Path) -> tuple[Path, int, int]:
    """The model directory, its parameters and its bytes (fp32)."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B))
    params = sum(p.numel() for p in model.parameters())  # tied embeddings once
    model.save_pretrained(out)
    build_tokenizer(TinyRecipe()).save_pretrained(out)
    return out, params, params * 4


def best_seconds(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def machine_bounds(nbytes: int, where: Path) -> dict[str, float]:
    """Memory copy, file write and file read GB/s on ``nbytes`` bytes."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_s = best_seconds(lambda: dst.copy_(src))
    data = memoryview(src.numpy())  # the tensor's own bytes, not a copy
    path = where / "bound.bin"
    write_s = best_seconds(lambda: path.write_bytes(data))
    read_s = best_seconds(lambda: read_into(path, dst))
    path.unlink()
    return {"memory_copy_gbs": nbytes / copy_s / GB, "file_write_gbs": nbytes / write_s / GB,
            "file_read_gbs": nbytes / read_s / GB}


def read_into(path: Path, tensor: torch.Tensor) -> None:
    """``path``'s bytes into ``tensor``'s memory, which holds them (a read, no allocation)."""
    with path.open("rb", buffering=0) as f:
        f.readinto(memoryview(tensor.numpy()).cast("B"))


def timed(fn, *args):
    """``fn(*args)`` on a worker: (its result, its seconds there)."""
    started = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - started


def engine_at(spec: EngineSpec, weights: WeightsRef) -> int:
    """The generation worker's engine at ``weights`` (loaded on first use); its version."""
    return generation_engine(spec, weights)[0].version


def version_bytes(ref: WeightsRef) -> int:
    path = Path(ref.path)
    return sum(f.stat().st_size for f in path.iterdir()) if path.is_dir() else path.stat().st_size


def one_store(client: Client, workers: list[str], model: Path, store: str | None,
              lora: LoraSpec | None, versions: int, first: int) -> dict:
    """Publish ``versions`` versions on the trainer and fetch each on the generator."""
    trainer, generator = workers
    engine = EngineSpec(str(model), "cpu", 1, lora=lora)
    train = TrainSpec(engine, UpdateParams(), store, keep_versions=2)

    def on(where, fn, *args):
        return client.submit(timed, fn, *args, workers=[where], pure=False).result()

    _, cold_s = on(generator, engine_at, engine, WeightsRef(0, str(model)))
    publish, fetch, nbytes = [], [], 0
    for version in range(first, first + versions):
        ref, seconds = on(trainer, publish_task, {}, train, version)
        publish.append(seconds)
        got, seconds = on(generator, engine_at, engine, ref)
        if got != version:
            raise RuntimeError(f"the generator's engine holds v{got}, not v{version}")
        fetch.append(seconds)
        if store is not None:
            nbytes = version_bytes(ref)
    return {"publish_s": min(publish), "fetch_s": min(fetch), "bytes": nbytes,
            "engine_cold_start_s": cold_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where the model and the run store go")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlhfless-weights-", dir=args.dir) as tmp:
        tmp = Path(tmp)
        model, params, nbytes = build_model_dir(tmp / "model")
        (tmp / "model-lora").symlink_to(model)  # engines and trainers are kept per path
        bounds = machine_bounds(nbytes, tmp)
        results = {}
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                          dashboard_address=None, memory_limit=0) as cluster, \
                Client(cluster) as client:
            workers = sorted(client.scheduler_info()["workers"])
            first = 1
            for kind, path, lora in (("full", model, None),
                                     ("adapter_r16", tmp / "model-lora", ADAPTER)):
                for store in ("run", "cluster"):
                    where = str(tmp / f"run-{kind}") if store == "run" else None
                    results[f"{store}/{kind}"] = one_store(client, workers, path, where, lora,
                                                           args.versions, first)
                    first += args.versions
                client.run(drop_trainer)
    for key, r in results.items():
        store, kind = key.split("/")
        if store == "cluster":  # its engine was loaded by the run store's turn
            del r["engine_cold_start_s"]
        r["bytes"] = r["bytes"] or results[f"run/{kind}"]["bytes"]
        r["publish_gbs"] = r["bytes"] / r["publish_s"] / GB
        r["fetch_gbs"] = r["bytes"] / r["fetch_s"] / GB
        r["publish_over_write_bound"] = r["publish_gbs"] / bounds["file_write_gbs"]
        r["fetch_over_read_bound"] = r["fetch_gbs"] / bounds["file_read_gbs"]
    full, adapter = results["run/full"], results["run/adapter_r16"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip()
    print(json.dumps({"model": "Qwen2.5-0.5B dims, random init, fp32", "params": params,
                      "model_bytes": nbytes, "bounds": bounds, "results": results,
                      "adapter_publish_over_full": adapter["publish_s"] / full["publish_s"],
                      "commit": commit, "load_avg": os.getloadavg(), "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
