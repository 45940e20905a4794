"""Where the trainer puts each policy version, and how a generation worker gets it.

``weight_store = "run"``: the version is written into the run directory
(``ops/engine/publish.py``), which every worker reads; the ``WeightsRef`` is its path.

``weight_store = "cluster"``: nothing is written. The trainer's worker holds the ``keep``
newest versions in memory (``version_files``: a copy of the tensors, and views of it as the
files' pieces) and answers a comm handler of its own, ``rlhfless_weights``; the
``WeightsRef`` names that worker (``holder``) and the version's name. A generation worker
whose engine needs the version asks the holder over Dask's comms, worker to worker, through
its own connection pool (so the cluster's TLS, where configured, covers the bytes); each
piece goes as a frame of its own, read into a buffer of its own and written from there into
the worker's local directory, whence the engine loads it (no copy of the whole). No
two machines need a common file system. A handler rather than a task pinned to the trainer:
the trainer's threads are busy updating the next version while generation workers fetch
(async mode), and a handler runs on the worker's event loop, beside them. Dask's shuffle
extends its workers the same way (``worker.handlers[...]``).

A trainer that restarts loses what it held; recovery publishes the restored version again
(``durable/recovery.py``), and the new ``WeightsRef`` names the new holder.

``weight_store = "<fsspec URL>"`` (``s3://bucket/prefix``, ``gcs://``, ``ftp://``, ...): the
trainer writes each version there (``ops/engine/url_store.py``: its own folder, then a
manifest, so a version is whole before any reader is told of it), and a generation worker
copies the version it needs into its local directory, as with ``cluster``: no two machines
need a common file system, only the store.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from distributed import get_worker
from distributed.protocol import to_serialize
from distributed.utils import sync

from rlhfless.ops.engine.engine_types import RemoteStore, WeightsRef
from rlhfless.ops.engine.url_store import fetch, publish_files, with_keep
from rlhfless.ops.engine.version_store import check_keep, install_files

if TYPE_CHECKING:
    import torch
    from peft import LoraConfig

HANDLER = "rlhfless_weights"  # the trainer worker's comm handler that serves versions
LOCAL_STORE = "rlhfless-weights"  # under a generation worker's local directory

# version -> (its name, its files' pieces, the versions kept): what this trainer holds
_HELD: dict[int, tuple[str, dict[str, list], int]] = {}


def publish_version(state: dict[str, torch.Tensor], store: str | RemoteStore | None,
                    version: int, keep: int, lora: LoraConfig | None = None) -> WeightsRef:
    """Publish ``state`` (all weights, or LoRA adapters with their ``lora`` config) as
    ``version``: into the directory ``store``, into the URL store ``store``, or, where
    ``store`` is None, held by this worker for the cluster to fetch. Each keeps the ``keep``
    newest versions up to ``version`` and drops newer ones."""
    # torch only here, on the trainer: generation workers import this module for
    # ``local_weights`` whatever their engine (the emulated one loads no torch)
    from rlhfless.ops.engine.publish import publish_state, version_files

    if isinstance(store, RemoteStore):
        name, files = version_files(state, version, lora)
        ref = publish_files(name, files, with_keep(store, keep), version)
        return replace(ref, nbytes=files_bytes(files))
    if store is not None:
        ref = publish_state(state, store, version, keep, lora)
        path = Path(ref.path)
        return replace(ref, nbytes=sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                       if path.is_dir() else path.stat().st_size)
    check_keep(keep)
    try:
        worker = get_worker()
    except ValueError:
        raise RuntimeError("weight_store = 'cluster' publishes from a Dask worker, which "
                           "serves the versions it holds; this task runs outside one") from None
    worker.handlers[HANDLER] = serve_version
    _HELD[version] = (*version_files(state, version, lora), keep)
    kept = [v for v in sorted(_HELD) if v <= version][-keep:]
    for held in list(_HELD):
        if held not in kept:
            del _HELD[held]
    return WeightsRef(version, _HELD[version][0], holder=worker.address,
                      nbytes=files_bytes(_HELD[version][1]))


def files_bytes(files: dict[str, list]) -> int:
    """The bytes of a version's files given as pieces (``publish.version_files``)."""
    return sum(memoryview(piece).nbytes for pieces in files.values() for piece in pieces)


def held_versions() -> list[int]:
    """The versions this process holds for the cluster, oldest first."""
    return sorted(_HELD)


def serve_version(version: int) -> dict:
    """The comm handler: version ``version``'s files, or which versions are held instead."""
    if version not in _HELD:
        return {"status": "missing", "held": held_versions()}
    name, files, keep = _HELD[version]
    return {"status": "OK", "name": name, "keep": keep,
            "files": {rel: [to_serialize(p) for p in pieces] for rel, pieces in files.items()}}


def local_weights(ref: WeightsRef) -> WeightsRef:
    """``ref`` as an engine loads it: unchanged where it is a path; where a URL store or a
    worker holds it, copied from there into this worker's local directory (the store's or
    the holder's ``keep`` newest versions stay there), and the path of the copy. A holder
    that has left the cluster (a trainer lost) is not asked: a task holding the old ``ref``
    fails at once, where asking waited for the connection's timeout (a host cut off) and
    held its worker that long."""
    if ref.remote is not None:
        return fetch(ref, Path(get_worker().local_directory) / LOCAL_STORE)
    if ref.holder is None:
        return ref
    worker = get_worker()
    cluster = sync(worker.loop, worker.scheduler.identity, n_workers=-1)["workers"]
    if ref.holder not in cluster:
        raise RuntimeError(f"worker {worker.address}: policy v{ref.version} was held by the "
                           f"trainer at {ref.holder}, which has left the cluster")
    reply = sync(worker.loop, worker.rpc(ref.holder).rlhfless_weights, version=ref.version)
    if reply["status"] != "OK":
        raise RuntimeError(f"worker {worker.address}: policy v{ref.version} is not held by "
                           f"the trainer at {ref.holder} (it holds {list(reply['held'])})")
    store = Path(worker.local_directory) / LOCAL_STORE
    return install_files(reply["name"], reply["files"], store, ref.version, reply["keep"])
