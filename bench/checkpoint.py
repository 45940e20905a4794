"""Checkpoint store throughput: our zarr v3 store vs safetensors, for the same state dict.

The state dict is generated here: ``--layers`` bf16 matrices of 2048 x 1024..2048, as many
fp32 norm vectors, one fp32 32000 x 1024 embedding and a 0-d step counter (about 250 MB with
the defaults, a small LM's weights in mixed precision). Each repeat, interleaved, writes it

* ``zarr``: with ``zarr_state.put_tensors`` into a fresh group (what a checkpoint's
  ``trainer/model`` is: uncompressed chunks, bf16 as uint16), then reads it back with
  ``get_tensors`` and copies every tensor into a preallocated state dict (what restoring
  into a model does);
* ``safetensors``: ``save_file`` to one file, then ``load_file`` and the same copies;

and the same writes again with every file fsync'ed (``_durable``, with ``fsync_tree``), and
the zarr write once more with every file also checksummed (``zarr_save_checksummed``:
``fsync_tree(checksum=True)``, what a checkpoint commit pays); ``verify`` is reading every
file of the zarr store back and checking it against the checksums (what ``latest`` pays on
resume). Before each write the previous output is deleted and the file system synced, so
that no timing pays for another's flushing. MB/s counts tensor bytes (1 MB = 1e6 bytes);
reads come from a warm page cache. Prints one JSON line of medians, with ``save_ratio``: the
median over repeats of zarr / safetensors save rate, each pair timed back to back (target at
least 0.5); ``save_ratio_checksummed``: the checksummed durable zarr write against the
durable safetensors one; ``checksum_cost``: durable zarr save time with checksums over
without.

    python bench/checkpoint.py [--layers 24] [--repeats 9] [--dir /some/fast/disk]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import zarr
from safetensors.torch import load_file, save_file

from rlhfless.pipeline.durable.checkpoint import crc32c, fsync_tree
from rlhfless.pipeline.durable.zarr_state import get_tensors, put_tensors


def make_state(layers: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(layers):
        cols = 1024 + 512 * (i % 3)
        state[f"layers.{i}.proj.weight"] = torch.randn(2048, cols, generator=g).to(torch.bfloat16)
        state[f"layers.{i}.norm.weight"] = torch.randn(cols, generator=g)
    state["embed.weight"] = torch.randn(32000, 1024, generator=g)
    state["step"] = torch.tensor(1234.0)
    return state


def settle() -> None:
    """Let the file system finish deleting and flushing earlier outputs before a timing."""
    os.sync()


def save_zarr(state, path: Path, durable: bool, checksum: bool = False) -> tuple[float, dict]:
    """Seconds to write (and fsync, checksum) ``state``; the files' entries if durable."""
    shutil.rmtree(path, ignore_errors=True)
    settle()
    started = time.perf_counter()
    put_tensors(zarr.open_group(path, mode="w", zarr_format=3), state)
    files = fsync_tree(path, checksum=checksum) if durable else {}
    return time.perf_counter() - started, files


def verify(path: Path, files: dict) -> float:
    """Read every file back and compare it with its checksum in ``files`` (as
    ``checkpoint.problem`` does, on 8 threads there, on one here)."""
    started = time.perf_counter()
    for rel, entry in files.items():
        if crc32c(path / rel) != entry["crc32c"]:
            raise RuntimeError(f"{rel}: checksum differs")
    return time.perf_counter() - started


def save_safetensors(state, path: Path, durable: bool) -> float:
    path.unlink(missing_ok=True)
    settle()
    started = time.perf_counter()
    save_file(state, str(path))
    if durable:
        fsync_tree(path)
    return time.perf_counter() - started


def load_into(read, into: dict[str, torch.Tensor]) -> float:
    started = time.perf_counter()
    for name, tensor in read().items():
        into[name].copy_(tensor)
    return time.perf_counter() - started


def paired_ratio(reference: list[float], ours: list[float]) -> float:
    """Median over repeats of our rate / the reference's, each pair timed back to back (a
    shared machine's load drifts less within a pair than across the run)."""
    return round(statistics.median(r / o for r, o in zip(reference, ours)), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    state = make_state(args.layers)
    into = {k: torch.empty_like(v) for k, v in state.items()}
    mb = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    zpath, spath = root / "state.zarr", root / "state.safetensors"
    times: dict[str, list[float]] = {}
    try:
        for _ in range(args.repeats):
            # each ratio's pair back to back: durable, checksummed, safetensors durable
            times.setdefault("zarr_save", []).append(save_zarr(state, zpath, False)[0])
            times.setdefault("safetensors_save", []).append(
                save_safetensors(state, spath, False))
            times.setdefault("zarr_save_durable", []).append(save_zarr(state, zpath, True)[0])
            seconds, files = save_zarr(state, zpath, durable=True, checksum=True)
            times.setdefault("zarr_save_checksummed", []).append(seconds)
            times.setdefault("safetensors_save_durable", []).append(
                save_safetensors(state, spath, True))
            times.setdefault("verify", []).append(verify(zpath, files))
            times.setdefault("zarr_load", []).append(
                load_into(lambda: get_tensors(zarr.open_group(zpath, mode="r")), into))
            times.setdefault("safetensors_load", []).append(
                load_into(lambda: load_file(str(spath)), into))
        files = sum(1 for p in zpath.rglob("*") if p.is_file())
        for name, tensor in into.items():  # the last load restored the state exactly
            if not torch.equal(tensor.view(-1).view(torch.uint8),
                               state[name].view(-1).view(torch.uint8)):
                raise RuntimeError(f"tensor {name} did not round-trip")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rates = {f"{k}_mb_s": round(mb / statistics.median(v), 1) for k, v in times.items()}
    out = {"bench": "checkpoint", "state_mb": round(mb, 1), "tensors": len(state),
           "repeats": args.repeats, **rates,
           "save_ratio": paired_ratio(times["safetensors_save"], times["zarr_save"]),
           "save_ratio_durable": paired_ratio(times["safetensors_save_durable"],
                                              times["zarr_save_durable"]),
           "save_ratio_checksummed": paired_ratio(times["safetensors_save_durable"],
                                                  times["zarr_save_checksummed"]),
           "checksum_cost": round(statistics.median(
               c / d for c, d in zip(times["zarr_save_checksummed"],
                                     times["zarr_save_durable"])), 2),
           "zarr_files": files}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
