"""A store of policy versions on disk: a directory of ``v<version>.safetensors`` files or
``v<version>/`` adapter directories (``publish.py`` writes them).

A version is written under a temporary name and renamed into place, so a reader never sees
half a file or a directory without its tensors; then only the ``keep`` newest versions up
to it stay, and any newer one (left by a run that resumed from an earlier checkpoint) goes.
The trainer's store is the run directory's (``weight_store = "run"``); a generation worker
keeps its own where the versions come over the cluster (``weight_store = "cluster"``).
Free of torch: a generation worker of any engine installs what it fetched.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .engine_types import WeightsRef

Buffer = Any  # what has the buffer protocol: bytes, a numpy array (abc.Buffer from 3.12)

_VERSION = re.compile(r"v(\d+)(?:\.safetensors)?")  # a published version's name


def process_umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets one to read it, and
    a file another thread made meanwhile would get that one)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o077)  # no /proc: the strictest in the meantime
    os.umask(mask)
    return mask


def check_keep(keep: int) -> None:
    """``keep`` versions in a store: at least the newest."""
    if keep < 1:
        raise ValueError(f"publish_weights: keep must be >= 1, got {keep}")


def install_files(name: str, files: dict[str, Sequence[Buffer]], store: str | Path,
                  version: int, keep: int = 2) -> WeightsRef:
    """Version ``version`` into ``store`` from its files by their paths under its ``name``
    (``""``: ``name`` is the file), each the pieces whose bytes in order are the file's
    (``publish.version_files`` makes them), the ``keep`` newest versions kept."""
    check_keep(keep)
    tmp = scratch_path(store, version)
    if "" not in files:
        tmp.mkdir(mode=0o777 & ~process_umask())
    for rel, pieces in files.items():
        write_pieces(tmp / rel if rel else tmp, pieces)
    return install(tmp, store / name, version, keep)


def write_pieces(path: Path, pieces: Sequence[Buffer]) -> None:
    """A new file of ``pieces``' bytes in order (its mode: what the umask gives)."""
    with path.open("xb") as f:
        for piece in pieces:
            f.write(piece)


def scratch_path(store: str | Path, version: int) -> Path:
    """Where this thread writes ``version`` before ``install`` renames it (``store`` made)."""
    store = Path(store)
    store.mkdir(parents=True, exist_ok=True)
    return store / f".v{version}.{os.getpid()}.{threading.get_ident()}.tmp"


def install(tmp: Path, final: Path, version: int, keep: int) -> WeightsRef:
    """``tmp`` renamed to ``final``; of the store's versions, the ``keep`` newest up to
    ``version`` stay and any newer one goes."""
    _rename_into(tmp, final)
    published = sorted(_published(final.parent))
    kept = [path for v, path in published if v <= version][-keep:]
    for _, path in published:
        if path not in kept:
            _remove(path)
    return WeightsRef(version, str(final))


def _rename_into(tmp: Path, final: Path) -> None:
    """``tmp`` becomes ``final``; a directory there already (a version published again
    after a resume) is moved aside first, since a rename does not replace a full one."""
    if final.is_dir():
        aside = final.with_name(f".{final.name}.{os.getpid()}.old")
        os.replace(final, aside)
        shutil.rmtree(aside)
    os.replace(tmp, final)


def _published(store: Path) -> list[tuple[int, Path]]:
    """(version, path) of every version in ``store``: files and adapter directories."""
    found = []
    for path in store.iterdir():
        m = _VERSION.fullmatch(path.name)
        if m:
            found.append((int(m.group(1)), path))
    return found


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
