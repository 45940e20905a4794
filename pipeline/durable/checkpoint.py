"""Checkpoints: a run's whole state in one zarr v3 store per iteration, committed atomically.

    runs/<name>/checkpoints/
        iter-00012/                      a zarr v3 group; its attributes: iteration, policy
            zarr.json                    version, data position, ledger totals, model path
            trainer/model/<tensor>       weights (bf16 bit-exact as uint16, fp32 as is)
            trainer/optimizer/<param>/   AdamW exp_avg, exp_avg_sq, step; param_groups
            trainer/rng/                 torch / numpy / python RNG of the trainer process
            driver/rng/                  the same for the driver
            driver/predictor/            LengthPredictor.state_dict()
            driver/throughput/           ThroughputModel.state_dict()
            tables/<name>.parquet        Arrow tables the driver keeps (a replay buffer)
            COMMITTED                    written last: every file above, its size and CRC32C
        .tmp-iter-00013-<pid>/           a checkpoint being written; never read

Commit: everything is written under ``.tmp-…``, every file checksummed (CRC32C, the checksum
zarr's own codec uses) and fsync'ed with its directory, then the ``COMMITTED`` manifest is
written and fsync'ed, and the directory renamed to ``iter-N`` (atomic on one file system) and
the parent fsync'ed. A checkpoint is *whole* when its manifest exists, parses, and every file
it lists has its size and checksum; ``latest`` returns the newest whole one and says why it
passed over the others (a crash mid-write, a truncated copy, a chunk overwritten in place), so
neither a half-written nor a damaged checkpoint is loaded. The checksum catches accidents (bit
rot, a bad copy, a stray write), not a forger with write access to the run. Reading every
byte back costs time, so only ``latest``, ``find`` and ``export.export_hf`` verify content;
``prune`` and the readers of a checkpoint that ``latest`` chose check sizes. ``prune`` keeps
the newest ``keep`` whole ones and removes the rest, but never the newest whole one whose
weights are all finite (the root attribute ``finite``, written by the driver from what every
trainer rank found; a checkpoint without it counts as finite).

Who writes what: the trainer worker writes ``trainer/`` itself
(``trainer.save_trainer_task``), the driver the root attributes, ``driver/`` and
``tables/``. Weights and optimizer state are
three times the model in fp32; shipping them through the scheduler to the driver would double
the traffic and hold them twice in memory, while the trainer shares the file system with the
driver on a LocalCluster and on HPC (published weights already rely on that).

Loading never unpickles: zarr metadata and the manifest are JSON, chunks raw bytes, tables
Parquet.

Exporting a checkpoint as a Hugging Face model: ``export.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import google_crc32c
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import zarr

from rlhfless.ops.algo.parallel import Ranks
from rlhfless.ops.engine.lora import adapter_scale

from .zarr_state import (
    get_tensors,
    get_tree,
    load_model_tensors,
    load_optimizer,
    load_trainer_rows,
    model_tensors,
    put_optimizer,
    put_rng,
    put_tensors,
    put_trainer_rows,
    put_tree,
    set_rng,
)

FORMAT = "rlhfless-checkpoint"
FORMAT_VERSION = 2  # 2: the manifest holds each file's CRC32C; 1 (sizes only) is still read
MARKER = "COMMITTED"
FSYNC_THREADS = 8  # concurrent fsyncs (and checksums) while committing or verifying
READ_CHUNK = 8 << 20  # bytes read at a time when checksumming
_NAME = re.compile(r"iter-(\d+)")


@dataclass
class DriverState:
    """What the driver restores: where the run was, and what its policy had learned."""

    iteration: int
    policy_version: int
    sampler_position: int  # prompts consumed so far (PromptSampler.position)
    predictor: dict[str, Any]  # LengthPredictor.state_dict()
    throughput: dict[str, Any]  # ThroughputModel.state_dict()
    update_seconds: float = 1.0  # ScalingPolicy.update_seconds
    kv: dict[str, Any] = field(default_factory=dict)  # ScalingPolicy.kv.state_dict()
    ledger_totals: dict[str, float] = field(default_factory=dict)
    model_path: str = ""  # the Hugging Face directory the run started from
    data_digest: str = ""  # fingerprint of the prompts the sampler draws from
    finite: bool = True  # every weight of every trainer rank is finite (no NaN or inf)
    tables: dict[str, pa.Table] = field(default_factory=dict)


def name_of(iteration: int) -> str:
    return f"iter-{iteration:05d}"


def iteration_of(path: str | Path) -> int | None:
    m = _NAME.fullmatch(Path(path).name)
    return int(m.group(1)) if m else None


# ---- writing -----------------------------------------------------------------------------

def begin(root: str | Path, iteration: int) -> Path:
    """A fresh temporary directory for the checkpoint of ``iteration``, holding the (empty)
    root group; the trainer and ``write_driver`` fill it, ``commit`` publishes it."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{name_of(iteration)}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    zarr.open_group(tmp, mode="w", zarr_format=3).attrs.update(
        {"format": FORMAT, "format_version": FORMAT_VERSION, "iteration": iteration})
    return tmp


def write_trainer(path: str | Path, model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer, ranks: Ranks | None = None) -> int:
    """Write the trainer's weights, optimizer state and RNG under ``path/trainer``; returns
    the bytes of tensors written. Called in the trainer's process; with ``ranks``, in every
    rank's, each writing its own rows (``zarr_state.put_trainer_rows``)."""
    if ranks is not None:
        return put_trainer_rows(Path(path), model, optimizer, ranks.rank, ranks.world)
    group = zarr.open_group(path, mode="r+").create_group(
        "trainer", attributes={"ranks": 1, "lora_scale": adapter_scale(model)})
    tensors = model_tensors(model)
    put_tensors(group.create_group("model"), tensors)
    put_optimizer(group.create_group("optimizer"), model, optimizer)
    put_rng(group.create_group("rng"))
    n = sum(t.numel() * t.element_size() for t in tensors.values())
    return n + sum(t.numel() * t.element_size() for s in optimizer.state.values()
                   for t in s.values() if torch.is_tensor(t))


def write_driver(path: str | Path, state: DriverState) -> None:
    """Write the driver's part: root attributes, its RNG, predictor and throughput state and
    its tables. Called in the driver's process."""
    root = zarr.open_group(path, mode="r+")
    root.attrs.update({
        "iteration": state.iteration, "policy_version": state.policy_version,
        "sampler_position": state.sampler_position, "update_seconds": state.update_seconds,
        "ledger_totals": state.ledger_totals, "model_path": state.model_path,
        "data_digest": state.data_digest, "tables": sorted(state.tables),
        "written_unix": time.time(), "kv": state.kv, "finite": state.finite,
    })
    driver = root.create_group("driver")
    put_rng(driver.create_group("rng"))
    put_tree(driver.create_group("predictor"), state.predictor)
    put_tree(driver.create_group("throughput"), state.throughput)
    if state.tables:
        (Path(path) / "tables").mkdir()
    for name, table in state.tables.items():
        pq.write_table(table, Path(path) / "tables" / f"{name}.parquet")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some platforms cannot fsync a directory; files are what matters
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def crc32c(path: Path) -> str:
    """The CRC32C of the file at ``path``, as 8 hex digits."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(READ_CHUNK):
            crc = google_crc32c.extend(crc, chunk)
    return f"{crc:08x}"


def _seal(path: Path, checksum: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"bytes": path.stat().st_size}
    if checksum:
        entry["crc32c"] = crc32c(path)
    _fsync(path)
    return entry


def fsync_tree(root: str | Path, checksum: bool = False) -> dict[str, dict[str, Any]]:
    """fsync every file and directory under ``root`` (a file: itself), concurrently so that
    the file system can group the journal commits; returns each file's ``{"bytes": size}``
    by path, with ``"crc32c"`` if ``checksum``."""
    root = Path(root)
    if root.is_file():
        return {root.name: _seal(root, checksum)}
    files, dirs = [], []
    for directory, _, names in os.walk(root):
        dirs.append(Path(directory))
        files += [Path(directory) / n for n in names]
    with ThreadPoolExecutor(FSYNC_THREADS) as pool:
        entries = list(pool.map(lambda p: _seal(p, checksum), files))
        list(pool.map(_fsync, dirs))
    return {p.relative_to(root).as_posix(): e for p, e in zip(files, entries)}


def commit(tmp: str | Path) -> Path:
    """Make the checkpoint in ``tmp`` durable and visible as ``iter-N``; returns its path."""
    tmp = Path(tmp)
    iteration = int(zarr.open_group(tmp, mode="r").attrs["iteration"])
    files = fsync_tree(tmp, checksum=True)
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "iteration": iteration,
                "files": dict(sorted(files.items()))}
    with open(tmp / MARKER, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync(tmp)
    final = tmp.parent / name_of(iteration)
    if final.exists():  # a stale or partial one of the same iteration: replace it
        old = tmp.parent / f".old-{final.name}-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    _fsync(tmp.parent)
    return final


# ---- finding and checking ----------------------------------------------------------------

def problem(path: str | Path, content: bool = True) -> str | None:
    """Why ``path`` is not a whole checkpoint, or None if it is. ``content=False`` checks the
    manifest and the sizes only, not the checksums (no file is read)."""
    path = Path(path)
    marker = path / MARKER
    if not marker.is_file():
        return f"no {MARKER} marker (written last): the checkpoint was not finished"
    try:
        manifest = json.loads(marker.read_text())
    except (OSError, ValueError) as err:
        return f"unreadable {MARKER} marker: {err}"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"{MARKER} is not an {FORMAT} manifest"
    if manifest.get("format_version") not in (1, FORMAT_VERSION):
        return (f"format version {manifest.get('format_version')!r}; this code reads "
                f"1 to {FORMAT_VERSION}")
    entries = {rel: e if isinstance(e, dict) else {"bytes": e}  # version 1: the size alone
               for rel, e in manifest.get("files", {}).items()}
    for rel, entry in entries.items():
        p = path / rel
        if not p.is_file():
            return f"missing file {rel}"
        if p.stat().st_size != entry["bytes"]:
            return f"file {rel} has {p.stat().st_size} bytes, the manifest says {entry['bytes']}"
    if not content:
        return None
    summed = [rel for rel, entry in entries.items() if "crc32c" in entry]
    with ThreadPoolExecutor(FSYNC_THREADS) as pool:
        found = list(pool.map(lambda rel: crc32c(path / rel), summed))
    for rel, crc in zip(summed, found):
        if crc != entries[rel]["crc32c"]:
            return (f"file {rel} has CRC32C {crc}, the manifest says {entries[rel]['crc32c']}: "
                    "its content changed after the commit")
    return None


def checkpoints(root: str | Path) -> list[Path]:
    """Every ``iter-N`` directory under ``root`` (whole or not), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and iteration_of(p) is not None]
    return sorted(found, key=iteration_of)


def latest(root: str | Path, content: bool = True,
           at_most: int | None = None) -> tuple[Path | None, list[str]]:
    """The newest whole checkpoint under ``root`` (None if there is none), and one line for
    every newer one passed over, saying why. ``content=False``: sizes only (``problem``).
    ``at_most``: of the checkpoints of that iteration or earlier."""
    skipped = []
    for path in reversed(checkpoints(root)):
        if at_most is not None and iteration_of(path) > at_most:
            continue
        why = problem(path, content)
        if why is None:
            return path, skipped
        skipped.append(f"{path}: {why}")
    return None, skipped


def is_finite(path: str | Path) -> bool:
    """Whether the checkpoint at ``path`` recorded finite weights (older ones did not say:
    True)."""
    return bool(zarr.open_group(path, mode="r").attrs.get("finite", True))


def prune(root: str | Path, keep: int, anchors: tuple[int, ...] = ()) -> list[Path]:
    """Keep the newest ``keep`` whole checkpoints, the newest whole finite one, and for each
    of ``anchors`` the newest whole one of that iteration or earlier (the collapse guard's
    good states); remove older ones, partial ones and leftover temporary directories.
    Returns what was removed."""
    if keep < 1:
        raise ValueError(f"prune: keep must be >= 1, got {keep}")
    root = Path(root)
    whole = [p for p in reversed(checkpoints(root)) if problem(p, content=False) is None]
    kept = whole[:keep]
    if not any(is_finite(p) for p in kept):  # a diverged run: keep its last finite state
        kept += [p for p in whole[keep:] if is_finite(p)][:1]
    for anchor in anchors:
        kept += [p for p in whole if iteration_of(p) <= anchor][:1]
    doomed = [p for p in whole if p not in kept] + [p for p in checkpoints(root)
                                                    if p not in whole]
    doomed += [p for p in root.iterdir() if p.name.startswith((".tmp-", ".old-"))]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


# ---- reading -----------------------------------------------------------------------------

def open_checkpoint(path: str | Path, content: bool = False) -> zarr.Group:
    """The root group of a whole checkpoint; ``ValueError`` naming the problem otherwise.
    Checksums are checked with ``content`` (the other callers found ``path`` with
    ``latest``, which checked them)."""
    why = problem(path, content)
    if why is not None:
        raise ValueError(f"checkpoint {path}: {why}")
    return zarr.open_group(path, mode="r")


def read_trainer(path: str | Path, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, ranks: Ranks | None = None,
                 restore_rng: bool = True) -> int:
    """Load weights, optimizer state and (by default) the RNG of the trainer into this
    process; returns the checkpoint's policy version. With ``ranks``: this rank's part of a
    checkpoint written by any number of ranks (and its RNG)."""
    root = open_checkpoint(path)
    if ranks is not None:
        load_trainer_rows(root["trainer"], model, optimizer, ranks.rank, ranks.world,
                          f"checkpoint {path}")
        return int(root.attrs["policy_version"])
    load_model_tensors(model, get_tensors(root["trainer/model"]), f"checkpoint {path}")
    load_optimizer(root["trainer/optimizer"], model, optimizer)
    if restore_rng:
        set_rng(root["trainer/rng"])
    return int(root.attrs["policy_version"])


def read_driver(path: str | Path, restore_rng: bool = True) -> DriverState:
    """The driver's state of a whole checkpoint; by default also restores its RNG here."""
    root = open_checkpoint(path)
    a = root.attrs
    if restore_rng:
        set_rng(root["driver/rng"])
    tables = {name: pq.read_table(Path(path) / "tables" / f"{name}.parquet")
              for name in a.get("tables", [])}
    return DriverState(
        iteration=int(a["iteration"]), policy_version=int(a["policy_version"]),
        sampler_position=int(a["sampler_position"]),
        predictor=get_tree(root["driver/predictor"]),
        throughput=get_tree(root["driver/throughput"]),
        update_seconds=float(a["update_seconds"]), ledger_totals=dict(a["ledger_totals"]),
        model_path=str(a["model_path"]), data_digest=str(a.get("data_digest", "")),
        tables=tables, kv=dict(a.get("kv", {})), finite=is_finite(path))


def find(run_path: str | Path, iteration: int | None = None, content: bool = True) -> Path:
    """The whole checkpoint of ``iteration`` in the run at ``run_path`` (default: newest);
    ``content=False`` checks sizes, not checksums (``problem``)."""
    root = Path(run_path) / "checkpoints"
    if iteration is None:
        path, skipped = latest(root, content)
        if path is None:
            raise FileNotFoundError(f"no whole checkpoint under {root} "
                                    f"({'; '.join(skipped) or 'none written'})")
        return path
    path = root / name_of(iteration)
    why = problem(path, content) if path.is_dir() else "not on disk"
    if why is not None:
        kept = [iteration_of(p) for p in checkpoints(root) if problem(p, content) is None]
        raise FileNotFoundError(f"checkpoint {path}: {why}; whole ones: {kept}")
    return path
