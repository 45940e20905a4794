"""Policy versions at an fsspec URL (``weight_store = "s3://bucket/prefix"``, ``gcs://``,
``ftp://``, ``file://``, ...): the trainer writes each version there and every generation
worker copies it into a local store of its own, so pools on machines with no common file
system train through an object store.

Object stores rename nothing atomically (a folder least of all), so a version is whole once
its manifest is written: each publish writes the version's files, named as in the run's
store (``v<N>.safetensors``, or the adapter directory ``v<N>/``), into a folder of its own,
``v<N>.<token>/``, and only then ``v<N>.json``, which names that folder, its files and their
sizes. The ``WeightsRef`` handed out names the folder, and only once it is whole; a version
published again (a resumed run) goes into a new folder and never overwrites one a worker is
reading. Then the manifests of the ``keep`` newest versions up to N stay and the others go,
before every folder that no kept manifest names (older versions, newer ones a resumed run
left, a publish cut off half way). A reader copies the folder's files, checks each against
the size the store lists, and installs them in its local store (``version_store.install``),
whence its engine loads them. Free of torch.
"""

from __future__ import annotations

import json
import posixpath
import re
import secrets
import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs

from .engine_types import RemoteStore, WeightsRef
from .version_store import Buffer, check_keep, install, process_umask, scratch_path

_MANIFEST = re.compile(r"v(\d+)\.json")  # a whole version's manifest
_FOLDER = re.compile(r"v(\d+)\.[0-9a-f]+")  # a version's files, whole or not
# bytes buffered per upload call: fsspec's default (64 KiB for FTP) made a STOR per 64 KiB;
# an S3 multipart upload takes parts of 5 MiB to 5 GiB
WRITE_BLOCK = 64 << 20


def open_store(store: RemoteStore) -> tuple[AbstractFileSystem, str]:
    """A client of the store's file system, not shared (fsspec caches one per arguments,
    and an FTP connection is not for two threads at once), and the store's path in it."""
    return url_to_fs(store.url, skip_instance_cache=True, **dict(store.options))


def publish_files(name: str, files: dict[str, Sequence[Buffer]], store: RemoteStore,
                  version: int) -> WeightsRef:
    """Version ``version`` written into ``store`` from its files by their paths under its
    ``name`` (``""``: ``name`` is the file), each as the pieces whose bytes in order are the
    file's (``publish.version_files``); the ``store.keep`` newest versions up to it stay."""
    check_keep(store.keep)
    fs, root = open_store(store)
    folder = f"v{version}.{secrets.token_hex(6)}"
    sizes = {}
    for rel, pieces in files.items():
        path = posixpath.join(root, folder, name, rel) if rel else posixpath.join(
            root, folder, name)
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        with fs.open(path, "wb", block_size=WRITE_BLOCK) as f:
            for piece in pieces:
                f.write(piece)
        sizes[rel] = sum(memoryview(piece).nbytes for piece in pieces)
    manifest = {"version": version, "folder": folder, "name": name, "files": sizes}
    fs.pipe_file(posixpath.join(root, f"v{version}.json"), json.dumps(manifest).encode())
    _prune(fs, root, version, store.keep, folder)
    return WeightsRef(version, f"{folder}/{name}", remote=store)


def published_versions(store: RemoteStore) -> dict[int, dict]:
    """The whole versions in ``store``: version -> its manifest."""
    fs, root = open_store(store)
    return {v: json.loads(fs.cat_file(posixpath.join(root, n))) for v, n in _manifests(fs, root)}


def fetch(ref: WeightsRef, local: str | Path) -> WeightsRef:
    """``ref``'s version copied from its URL store into the local store ``local`` (the
    store's ``keep`` newest versions stay there), and the path of the copy."""
    store = ref.remote
    fs, root = open_store(store)
    src = posixpath.join(root, ref.path)
    try:
        info = fs.info(src)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"policy v{ref.version}: {ref.path} is not in the weight store {store.url} (its "
            f"{store.keep} newest versions stay there: raise keep_weights)") from None
    listed = {src: info} if info["type"] == "file" else fs.find(src, detail=True)
    tmp = scratch_path(local, ref.version)
    try:
        if info["type"] != "file":
            tmp.mkdir(mode=0o777 & ~process_umask())
        for path, entry in listed.items():
            rel = path[len(src):].lstrip("/")
            dest = tmp / rel if rel else tmp
            dest.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(path, str(dest))
            if dest.stat().st_size != entry["size"]:
                raise OSError(f"policy v{ref.version}: {store.url}/{ref.path}/{rel} came as "
                              f"{dest.stat().st_size} bytes of {entry['size']}")
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise
    return install(tmp, Path(local) / posixpath.basename(ref.path), ref.version, store.keep)


def with_keep(store: RemoteStore, keep: int) -> RemoteStore:
    """``store`` keeping ``keep`` versions."""
    return store if store.keep == keep else replace(store, keep=keep)


def _manifests(fs: AbstractFileSystem, root: str) -> list[tuple[int, str]]:
    """(version, manifest name) of every whole version under ``root``, oldest first."""
    return sorted((int(m.group(1)), m.group(0)) for m in map(_MANIFEST.fullmatch, _names(fs, root))
                  if m)


def _names(fs: AbstractFileSystem, root: str) -> list[str]:
    fs.invalidate_cache()  # a listing cached before this publish wrote its files
    return [posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False)]


def _prune(fs: AbstractFileSystem, root: str, version: int, keep: int, current: str) -> None:
    """The ``keep`` newest whole versions up to ``version`` stay (``current``, the folder
    just written, among them): other manifests go first, then the folders none names."""
    manifests = _manifests(fs, root)
    kept = [n for v, n in manifests if v <= version][-keep:]
    for _, n in manifests:
        if n not in kept:
            fs.rm_file(posixpath.join(root, n))
    folders = {current} | {json.loads(fs.cat_file(posixpath.join(root, n)))["folder"]
                           for n in kept if n != f"v{version}.json"}
    for n in _names(fs, root):
        if _FOLDER.fullmatch(n) and n not in folders:
            fs.rm(posixpath.join(root, n), recursive=True)
