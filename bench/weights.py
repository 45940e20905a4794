"""Weights at a real model's size: each version's publish and fetch seconds, and the
trainer's checkpoint, held against this machine's own bounds measured in the same invocation.

The model is Qwen2.5-0.5B-shaped (its published config: hidden 896, 24 layers, 14 query and
2 KV heads, MLP 4864, vocabulary 151,936, tied embeddings; 494M parameters) or, with
``--dims 1.5b``, Qwen2.5-1.5B-shaped (hidden 1536, 28 layers, 12 query heads, MLP 8960;
1.54B), random weights built here, saved once as a model directory (the embedded tiny
model's tokenizer, built without its model, beside them: nothing is generated). A real
LocalCluster of two worker processes runs the real tasks: the trainer's ``publish_task`` on
one, and on the other ``generation_engine`` (our ``hf`` engine: its cold start is the base
load, then each version's fetch and load into the engine). For each weight store (``run``:
files in the run directory; ``cluster``: held by the trainer, fetched worker to worker over
Dask's comms) and each kind of version (the full weights; a rank-16 LoRA adapter on q, k, v,
o), it times ``--versions`` versions and keeps the fastest. Then the full-weight trainer's
checkpoint: its weights and AdamW's two moments written and committed (fsync'd,
checksummed), and restored into it.

The bounds, on the same bytes (the model's): memory copy (one tensor copied into another),
file write (into the page cache, and made durable with fsync) and file read into memory
already allocated (the store's file system, through the page cache as the publish's own
write and the fetch's read go). Ratios: a version's bytes per second over the bound
(publish: over the write bound and the copy bound; fetch: over the read bound and the copy
bound); the checkpoint's write over the durable write bound, its restore over the read
bound. Prints one JSON line.

    python bench/weights.py [--versions 2] [--dims 0.5b|1.5b] [--stores run,cluster]
                            [--no-checkpoint] [--dir DIR]
"""

from __future__ import annotations

import argparse
import gc
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
from rlhfless.pipeline.durable.checkpoint import DriverState, begin, commit, write_driver
from rlhfless.pipeline.tasks.rollout import _ENGINE, generation_engine
from rlhfless.pipeline.tasks.trainer import (
    TrainSpec,
    _trainer,
    drop_trainer,
    publish_task,
    restore_trainer_task,
    save_trainer_task,
    start_trainer_task,
)

QWEN25_05B = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
              "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
              "max_position_embeddings": 32768, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": True}
QWEN25_15B = {**QWEN25_05B, "hidden_size": 1536, "intermediate_size": 8960,
              "num_hidden_layers": 28, "num_attention_heads": 12}
DIMS = {"0.5b": QWEN25_05B, "1.5b": QWEN25_15B}  # Qwen2.5's published configs
ADAPTER = LoraSpec(rank=16, alpha=32.0)
GB = 1e9


def build_model_dir(out: Path, dims: dict) -> tuple[Path, int, int]:
    """The model directory, its parameters and its bytes (fp32)."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**dims))
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
    """Memory copy, file write (into the page cache, and made durable: fsync'd) and file
    read GB/s on ``nbytes`` bytes."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    copy_s = best_seconds(lambda: dst.copy_(src))
    data = memoryview(src.numpy())  # the tensor's own bytes, not a copy
    path = where / "bound.bin"
    write_s = best_seconds(lambda: path.write_bytes(data))
    durable_s = best_seconds(lambda: write_durably(path, data))
    read_s = best_seconds(lambda: read_into(path, dst))
    path.unlink()
    return {"memory_copy_gbs": nbytes / copy_s / GB, "file_write_gbs": nbytes / write_s / GB,
            "file_write_fsync_gbs": nbytes / durable_s / GB,
            "file_read_gbs": nbytes / read_s / GB}


def write_durably(path: Path, data: memoryview) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_into(path: Path, tensor: torch.Tensor) -> None:
    """``path``'s bytes into ``tensor``'s memory, which holds them (a read, no allocation;
    one read returns at most 2 GiB on Linux, so as many as it takes)."""
    view = memoryview(tensor.numpy()).cast("B")
    with path.open("rb", buffering=0) as f:
        done = 0
        while done < len(view):
            done += f.readinto(view[done:])


def timed(fn, *args):
    """``fn(*args)`` on a worker: (its result, its seconds there)."""
    started = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - started


def engine_at(spec: EngineSpec, weights: WeightsRef) -> int:
    """The generation worker's engine at ``weights`` (loaded on first use); its version."""
    return generation_engine(spec, weights)[0].version


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
        nbytes = ref.nbytes
    return {"publish_s": min(publish), "fetch_s": min(fetch), "bytes": nbytes,
            "engine_cold_start_s": cold_s}


def drop_engine() -> None:
    """Forget this worker's engines (the next kind of version loads its own)."""
    _ENGINE.clear()
    gc.collect()


def checkpoint_round(train: TrainSpec, root: str) -> dict:
    """On the trainer: its checkpoint written (weights and AdamW's two moments, made by one
    step on zero gradients, which moves no weight), committed (fsync'd, checksummed), then
    restored into it; seconds and bytes."""
    trainer = _trainer(train)
    start_trainer_task(train, 0, "bench")
    params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    started = time.perf_counter()
    tmp = begin(root, 1)
    written = save_trainer_task(train, str(tmp), "bench")
    write_driver(tmp, DriverState(1, trainer.version, 0, {}, {}))
    final = commit(tmp)
    write_s = time.perf_counter() - started
    restore_s = timed(restore_trainer_task, train, str(final), "bench")[1]
    return {"bytes": written["bytes"], "write_s": write_s, "restore_s": restore_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", type=int, default=2)
    ap.add_argument("--dims", choices=sorted(DIMS), default="0.5b", help="Qwen2.5 size")
    ap.add_argument("--stores", default="run,cluster", help="run, or run,cluster")
    ap.add_argument("--checkpoint", action=argparse.BooleanOptionalAction, default=True,
                    help="the full trainer's checkpoint write and restore (3x the weights)")
    ap.add_argument("--dir", default=None, help="where the model and the run store go")
    args = ap.parse_args()
    stores = args.stores.split(",")
    if stores[0] != "run" or not set(stores) <= {"run", "cluster"}:
        ap.error("--stores: run, then optionally cluster (its bytes are the run store's)")
    with tempfile.TemporaryDirectory(prefix="rlhfless-weights-", dir=args.dir) as tmp:
        tmp = Path(tmp)
        model, params, nbytes = build_model_dir(tmp / "model", DIMS[args.dims])
        (tmp / "model-lora").symlink_to(model)  # engines and trainers are kept per path
        bounds = machine_bounds(nbytes, tmp)
        results, checkpoint = {}, None
        with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                          dashboard_address=None, memory_limit=0) as cluster, \
                Client(cluster) as client:
            workers = sorted(client.scheduler_info()["workers"])
            first = 1
            for kind, path, lora in (("full", model, None),
                                     ("adapter_r16", tmp / "model-lora", ADAPTER)):
                for store in stores:
                    where = str(tmp / f"run-{kind}") if store == "run" else None
                    results[f"{store}/{kind}"] = one_store(client, workers, path, where, lora,
                                                           args.versions, first)
                    first += args.versions
                if kind == "full" and args.checkpoint:
                    train = TrainSpec(EngineSpec(str(path), "cpu", 1), UpdateParams(), None)
                    checkpoint = client.submit(checkpoint_round, train, str(tmp / "ckpt"),
                                               workers=[workers[0]], pure=False).result()
                client.run(drop_trainer)
                client.run(drop_engine)
    for key, r in results.items():
        store, kind = key.split("/")
        if store == "cluster":  # its engine was loaded by the run store's turn
            del r["engine_cold_start_s"]
        r["bytes"] = r["bytes"] or results[f"run/{kind}"]["bytes"]
        r["publish_gbs"] = r["bytes"] / r["publish_s"] / GB
        r["fetch_gbs"] = r["bytes"] / r["fetch_s"] / GB
        r["publish_over_write_bound"] = r["publish_gbs"] / bounds["file_write_gbs"]
        r["fetch_over_read_bound"] = r["fetch_gbs"] / bounds["file_read_gbs"]
        r["publish_over_copy_bound"] = r["publish_gbs"] / bounds["memory_copy_gbs"]
        r["fetch_over_copy_bound"] = r["fetch_gbs"] / bounds["memory_copy_gbs"]
    if checkpoint is not None:
        c = checkpoint
        c["write_over_fsync_write_bound"] = (c["bytes"] / c["write_s"] / GB
                                             / bounds["file_write_fsync_gbs"])
        c["restore_over_read_bound"] = c["bytes"] / c["restore_s"] / GB / bounds["file_read_gbs"]
    full, adapter = results["run/full"], results["run/adapter_r16"]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=Path(__file__).parent).stdout.strip()
    print(json.dumps({"model": f"Qwen2.5-{args.dims.upper()} dims, random init, fp32",
                      "params": params, "model_bytes": nbytes, "bounds": bounds,
                      "results": results, "checkpoint": checkpoint,
                      "adapter_publish_over_full": adapter["publish_s"] / full["publish_s"],
                      "commit": head, "load_avg": os.getloadavg(), "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
