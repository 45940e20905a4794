"""A cgroup per sandboxed call: one memory and process limit on a whole process tree.

``Cgroup.make(memory_bytes, processes)`` makes a child of this process's own cgroup with
``memory_bytes`` of memory (swap not allowed) and at most ``processes`` tasks, in the unified
hierarchy (cgroup v2: ``memory.max``, ``memory.swap.max``, ``pids.max``) where this
process's cgroup delegates the memory and pids controllers, else in the v1 ``memory`` and
``pids`` hierarchies (``memory.limit_in_bytes``, ``memory.memsw.limit_in_bytes``,
``pids.max``). It returns ``None`` where neither can be made (no permission, no
controller): the caller then falls back to rlimits and says so.

``enter()`` moves the calling process into the cgroup (call it in the child before
``exec``); ``destroy()`` kills whatever is still inside, waits for it to be gone and
removes the cgroup.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path

_SERIAL = itertools.count()
EMPTY_WAIT_S = 2.0  # how long destroy() waits for killed tasks to leave


def _mounts() -> dict[str, tuple[str, str]]:
    """{controller or "unified": (hierarchy root inside the mount, mount point)}."""
    found: dict[str, tuple[str, str]] = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, (fstype, _source, opts) = left.split(), right.split()[:3]
        if fstype == "cgroup2":
            found.setdefault("unified", (fields[3], fields[4]))
        elif fstype == "cgroup":
            for opt in opts.split(","):
                found.setdefault(opt, (fields[3], fields[4]))
    return found


def _own() -> dict[str, str]:
    """{controller or "unified": this process's cgroup path} from /proc/self/cgroup."""
    own: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else ["unified"]:
            own[c] = path
    return own


class Cgroup:
    def __init__(self, dirs: list[Path]) -> None:
        self.dirs = dirs

    @classmethod
    def make(cls, memory_bytes: int, processes: int) -> Cgroup | None:
        try:
            return cls._make(memory_bytes, processes)
        except (OSError, ValueError):  # no cgroup file system we can read or write
            return None

    @classmethod
    def _make(cls, memory_bytes: int, processes: int) -> Cgroup | None:
        mounts, own = _mounts(), _own()
        name = f"rlhfless-tool-{os.getpid()}-{next(_SERIAL)}"

        def place(key: str) -> Path | None:
            if key not in mounts or key not in own:
                return None
            root, point = mounts[key]
            rel = os.path.relpath(own[key], root) if root != "/" else own[key].lstrip("/")
            return None if rel.startswith("..") else Path(point, rel, name)

        v2 = place("unified")
        if v2 is not None and {"memory", "pids"} <= set(
                (v2.parent / "cgroup.subtree_control").read_text().split()
                if (v2.parent / "cgroup.subtree_control").exists() else []):
            limits = {v2: [("memory.max", memory_bytes), ("memory.swap.max", 0),
                           ("pids.max", processes)]}
        else:
            mem, pids = place("memory"), place("pids")
            if mem is None or pids is None:
                return None
            limits = {mem: [("memory.limit_in_bytes", memory_bytes),
                            ("memory.memsw.limit_in_bytes", memory_bytes)],
                      pids: [("pids.max", processes)]}
        group = cls([])
        try:
            for path, settings in limits.items():
                path.mkdir()
                group.dirs.append(path)
                for key, value in settings:
                    if (path / key).exists() or key != "memory.memsw.limit_in_bytes":
                        (path / key).write_text(str(value))
        except OSError:
            group.destroy()
            return None
        return group

    def enter(self) -> None:
        for path in self.dirs:
            (path / "cgroup.procs").write_text(str(os.getpid()))

    def _tasks(self) -> set[int]:
        tasks: set[int] = set()
        for path in self.dirs:
            try:
                tasks |= {int(t) for t in (path / "cgroup.procs").read_text().split()}
            except OSError:
                continue
        return tasks

    def destroy(self) -> None:
        end = time.monotonic() + EMPTY_WAIT_S
        while (tasks := self._tasks()) and time.monotonic() < end:
            for pid in tasks:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        for path in self.dirs:
            try:
                path.rmdir()
            except OSError:
                pass
