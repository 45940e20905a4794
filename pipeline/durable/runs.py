"""The run directory: everything a run writes lives under ``runs/<name>/``.

    config.json          the resolved configuration
    config_changes.jsonl what each --resume changed (old and new value; recovery.RESUMABLE)
    metrics.jsonl        one JSON object per iteration (and per held-out evaluation)
    decisions.jsonl      every scaling, migration and release decision (elastic policy)
    ledger.json          worker-seconds and cost per pool, per iteration, per worker
    dashboard.json       the Dask dashboard link, and whether the run has ended
    report/              ``rlhfless report``: index.html and its figures (at the end of a run
                         whose trackers keep files, with graph.png, the iteration graph)
    tb/                  TensorBoard scalars (report_to; by default when tensorboard is installed)
    wandb/ mlflow.db mlflow-artifacts/ trackio/   the other trackers' local stores (report_to)
    rollouts/iter-N.parquet   every sample of iteration N
    weights/vN.safetensors    the newest published policy versions (vN/: a LoRA run's adapter)
    checkpoints/iter-N/       zarr v3 checkpoints, committed atomically (checkpoint.py)
    .rlhfless-run        marker: this directory is a run (only such a directory is overwritten)
    .lock                held (``flock``) by the one process that owns the run while it lives
    tls/                 the cluster's key and certificate of this start (0700/0600; security.py)
    ranks/               the trainer ranks' rendezvous stores (0700; ranks.py)

A run name is one path component (``config.RUN_NAME``). The process that creates or resumes a
run holds an exclusive ``flock`` on ``.lock`` until it ends; the kernel releases it on any
exit, SIGKILL included, so a lock is never stale. A second process (a second ``train`` of the
same name, ``--resume`` or ``--overwrite`` of a live run) is refused and touches nothing.
``--overwrite`` replaces only a directory with the marker: it takes the old run's lock, renames
the directory aside to a hidden sibling (``.<name>.replaced-<id>``, still locked) and creates
the new run. The old run is deleted only once the new one has recorded its first iteration
(``drop_replaced``, or ``release``); any failure before that puts it back as it was
(``restore_replaced``), so a mistake (a bad dataset, a wrong model) loses nothing. A process
killed in between leaves the old run under the hidden name, to be renamed back by hand. A run
that never recorded an iteration (it failed or was killed first) is replaced so, without
``--overwrite``.

Files are written to a temporary name and renamed into place, so a reader never mistakes
a partial file for a whole one. JSON lines are appended one record per write; a last line
cut short (a writer killed mid-line) is passed over by ``read_jsonl`` and dropped by
``rewrite_jsonl`` (on resume), so that the next record starts on a fresh line; any other
line that is not JSON is an error naming file and line. Everything written is strict JSON:
a NaN or infinite number is written as ``null`` and its key listed under ``"nonfinite"``.
Every metrics record is also handed to ``listeners`` (a notebook's live plot, the trackers),
in the order appended, as it was given.

A run is private to its Unix user: ``train`` and ``--resume`` run under ``umask(run_umask)``
(config key, default 0o077: directories 0700, files 0600), and the local cluster's worker
processes inherit it (batch jobs set it in their script, deploy.py), so rollouts, metrics,
weights and checkpoints written by the driver or by a worker alike are the run user's only;
``run_umask = 0o022`` shares them read-only (0755/0644).
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..config import Config

MARKER = ".rlhfless-run"
LOCK = ".lock"


class RunDirError(RuntimeError):
    """A run directory cannot be created, replaced or taken; the message says why and what
    to do, in one line."""


def is_run(path: Path) -> bool:
    """Whether ``path`` is a run directory of ours (a real directory with the marker)."""
    return path.is_dir() and not path.is_symlink() and (path / MARKER).is_file()


def lock_run(path: Path, note: bool = True):
    """The open lock file of the run in ``path``, locked exclusively; ``RunDirError`` if
    another process holds it. The lock lasts as long as the file stays open. ``note``: write
    this process into it (without, the file is left as it was)."""
    lock = (path / LOCK).open("a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        owner = lock.read().strip() or "another process"
        lock.close()
        raise RunDirError(f"run directory {path} is in use by a live run ({owner}); wait for "
                          "it to end or choose another name (--set name=...)") from None
    if not note:
        return lock
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}")
    lock.flush()
    return lock


def _remove_run(path: Path) -> None:
    """Remove the run in ``path`` (ours, and locked by this process): renamed aside first, so
    that the name never points at a half-removed run, then deleted."""
    aside = path.with_name(f".{path.name}.removing-{uuid.uuid4().hex[:8]}")
    os.rename(path, aside)
    shutil.rmtree(aside)


def _started(path: Path) -> bool:
    """Whether the run in ``path`` recorded an iteration (a torn last line is no record)."""
    metrics = path / "metrics.jsonl"
    if not metrics.exists():
        return False
    for line in metrics.read_text().splitlines():
        try:
            if json.loads(line).get("event") == "iteration":
                return True
        except (ValueError, AttributeError):
            continue
    return False


class _Replaced:
    """An old run renamed aside by ``--overwrite``, kept (and locked) until the new run
    stands or fails."""

    def __init__(self, path: Path, lock) -> None:
        self.path, self.lock = path, lock
        self.aside = path.with_name(f".{path.name}.replaced-{uuid.uuid4().hex[:8]}")
        os.rename(path, self.aside)

    def drop(self) -> None:
        shutil.rmtree(self.aside)
        self.lock.close()

    def restore(self) -> None:
        """Remove the new run in ``path`` and put the old one back under its name."""
        if self.path.exists():
            _remove_run(self.path)
        os.rename(self.aside, self.path)
        self.lock.close()


def _claim(path: Path, overwrite: bool):
    """Make ``path`` a new, empty run directory locked by this process; returns the lock and
    the old run set aside (``_Replaced``), if there was one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir()
            return lock_run(path), None
        except FileExistsError:
            pass
        if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
            return lock_run(path), None  # an empty directory: take it
        if not is_run(path):
            raise RunDirError(f"{path} exists and is not a run directory (no {MARKER}); "
                              "choose another name (--set name=...) or runs_dir; --overwrite "
                              "replaces only a run")
        old = lock_run(path, note=False)  # refused while the old run is live, --overwrite or not
        if not overwrite and _started(path):  # one that never recorded an iteration holds
            old.close()  # nothing to resume and must not block a rerun
            raise RunDirError(f"run directory {path} exists; choose another name "
                              "(--set name=...) or pass --overwrite")
        try:
            replaced = _Replaced(path, old)
        except BaseException:
            old.close()
            raise
        try:
            path.mkdir()
            return lock_run(path), replaced
        except BaseException:
            replaced.restore()
            raise
    except (PermissionError, FileExistsError, NotADirectoryError) as err:
        raise RunDirError(f"cannot create run directory {path}: {err.strerror}; choose a "
                          "writable runs_dir (--set runs_dir=...)") from None


@contextmanager
def umask(mask: int) -> Iterator[None]:
    """This process's umask is ``mask`` for the block (processes it starts inherit it)."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _finite(value: Any, key: str, nonfinite: list[str]) -> Any:
    """``value`` with every NaN or infinite float replaced by None (their keys noted)."""
    if isinstance(value, dict):
        return {k: _finite(v, f"{key}.{k}" if key else str(k), nonfinite)
                for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v, key, nonfinite) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        nonfinite.append(key)
        return None
    return value


def dumps(record: Any, indent: int | None = None) -> str:
    """``record`` as strict JSON (numpy scalars as numbers): a NaN or infinite number becomes
    ``null``, and a dict record lists those keys under ``"nonfinite"``."""
    plain = json.loads(json.dumps(record, default=float))  # numpy scalars -> float
    nonfinite: list[str] = []
    clean = _finite(plain, "", nonfinite)
    if nonfinite and isinstance(clean, dict):
        clean["nonfinite"] = sorted(set(nonfinite))
    return json.dumps(clean, indent=indent, allow_nan=False)


def parse_jsonl(path: Path) -> tuple[list[dict], bool]:
    """The records of the JSON-lines file at ``path``, and whether it ends as a whole line
    (empty, or a newline last). A last line with no newline after it that is not JSON (a
    writer killed mid-line) is passed over; any other line that is not JSON raises
    ``ValueError`` naming file and line."""
    text = path.read_text()
    lines = text.split("\n")  # the last item is what follows the last newline
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError as err:
            if number < len(lines):
                raise ValueError(f"{path}:{number}: not a JSON record ({err.msg}); fix or "
                                 "remove that line") from None
    return records, not lines[-1]


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.listeners: list[Callable[[dict], None]] = []
        self._lock = None  # the open, locked .lock of a run this process owns
        self._replaced: _Replaced | None = None  # the old run --overwrite set aside

    @classmethod
    def create(cls, cfg: Config, overwrite: bool = False) -> RunDir:
        """A new run directory, locked by this process until ``release``. An existing run
        that is not live is replaced with ``overwrite``, or when it never recorded an
        iteration; nothing else is ever removed. The run replaced is kept aside until
        ``drop_replaced`` or ``release``, and ``restore_replaced`` puts it back."""
        path = cfg.run_dir  # cfg.name is one safe path component (config.py)
        run = cls(path)
        run._lock, run._replaced = _claim(path, overwrite)
        try:
            (path / MARKER).write_text(json.dumps({"name": cfg.name, "created": time.time()}))
            (path / "rollouts").mkdir(exist_ok=True)
            run.write_json("config.json", cfg.to_dict())
        except BaseException:
            run.restore_replaced()
            run.release()
            raise
        return run

    @classmethod
    def take(cls, path: str | Path) -> RunDir:
        """The existing run in ``path``, locked by this process (to resume it)."""
        run = cls(path)
        run._lock = lock_run(run.path)
        if not (run.path / MARKER).exists():  # a run written before the marker existed
            (run.path / MARKER).write_text(json.dumps({"name": run.path.name}))
        return run

    def drop_replaced(self) -> None:
        """Delete the old run that ``create`` set aside (the new one has started)."""
        if self._replaced is not None:
            self._replaced.drop()
            self._replaced = None

    def restore_replaced(self) -> None:
        """Remove this new run and put back the old one that ``create`` set aside, as it was;
        nothing happens if there is none (or it was dropped)."""
        if self._replaced is not None:
            self._replaced.restore()
            self._replaced = None

    def release(self) -> None:
        """Give up the lock (also released when this process exits, however it exits); an
        old run still set aside is dropped: the run this process made stands."""
        self.drop_replaced()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    @property
    def weights(self) -> Path:
        return self.path / "weights"

    def write_json(self, name: str, obj) -> None:
        tmp = self.path / f".{name}.tmp"
        tmp.write_text(dumps(obj, indent=1))
        os.replace(tmp, self.path / name)

    def read_json(self, name: str):
        return json.loads((self.path / name).read_text())

    def append_metrics(self, record: dict) -> None:
        self.append_jsonl("metrics.jsonl", record)
        for listener in self.listeners:
            listener(record)

    def append_jsonl(self, name: str, record: dict) -> None:
        with (self.path / name).open("a") as f:
            f.write(dumps(record) + "\n")

    def metrics(self) -> list[dict]:
        return self.read_jsonl("metrics.jsonl")

    def read_jsonl(self, name: str) -> list[dict]:
        """The records of ``name``; a last line cut short is passed over (``parse_jsonl``)."""
        path = self.path / name
        return parse_jsonl(path)[0] if path.exists() else []

    def rewrite_jsonl(self, name: str, keep: Callable[[dict], bool] = lambda r: True) -> None:
        """Rewrite ``name`` with the records ``keep`` accepts, atomically, if that drops a
        record or the file does not end with a whole line; otherwise leave it as it is."""
        path = self.path / name
        if not path.exists():
            return
        records, whole = parse_jsonl(path)
        kept = [r for r in records if keep(r)]
        if not whole or len(kept) != len(records):
            tmp = self.path / f".{name}.tmp"
            tmp.write_text("".join(dumps(r) + "\n" for r in kept))
            os.replace(tmp, path)

    def write_rollouts(self, iteration: int, table: pa.Table) -> Path:
        final = self.path / "rollouts" / f"iter-{iteration:05d}.parquet"
        tmp = final.with_suffix(".tmp")
        pq.write_table(table.replace_schema_metadata(None), tmp)
        os.replace(tmp, final)
        return final
