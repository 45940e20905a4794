"""The sandbox of the built-in Python code tool: ``run_python(code, sandbox, limits)``.

Where bubblewrap (``bwrap``) can make namespaces, the code runs in a fresh sandbox:

* identity: uid/gid 65534 (``nobody``). When the run is root, bwrap runs privileged without
  a user namespace and the sandbox's init drops to the kernel's uid 65534 (keeping no
  capability, its bounding set empty) before it unpacks or runs anything, so the code holds
  neither root's files nor its signals; a non-root run cannot change its kernel uid, and
  there a user namespace maps 65534 onto the run's uid. ``enforced["user"]`` is what the
  init measured after its drop (its uid, and the uid outside when a user namespace maps it).
  bwrap sets ``no_new_privs``: setuid binaries give nothing;
* namespaces: its own PID, mount, network (empty: no interface but a down loopback), IPC and
  UTS namespaces, a new session, killed with the process that started it;
* files: a read-only view of ``/usr`` (and ``/bin``, ``/lib*`` as on the host), the Python
  installation and a few files of ``/etc`` (not ``shadow``, not ``passwd``); nothing of the
  run. The only writable place is ``/sandbox`` (its working directory, ``HOME`` and
  ``TMPDIR``), a tmpfs of ``disk_bytes``. The host directory ``sandbox`` is copied in
  before the code runs and replaced by the tmpfs' regular files and directories after it
  ends, so an episode's calls see each other's files;
* limits on the whole process tree: a cgroup (memory ``memory_bytes + disk_bytes``, the
  tmpfs included, no swap; ``processes``) where this process may make one, else
  ``RLIMIT_NPROC`` (per sandbox inside a user namespace; counted over all of uid 65534's
  processes where the run is root) and only per-process memory; always, per process,
  ``RLIMIT_AS`` = ``memory_bytes`` (so one large allocation is a ``MemoryError``, not a
  kill), ``RLIMIT_CPU``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, no core dumps;
* time: at ``wall_s`` the code's processes are killed; the sandbox is torn down at
  ``wall_s + GRACE_S`` whatever runs in it. Output is read with a bounded reader that never
  waits past that deadline, so a child holding a pipe cannot hold the call.

Without working namespaces the fallback layer runs: the run's own user, Landlock and rlimits
(below).
Every result says in ``enforced`` which layer ran (``"sandbox": "bubblewrap"`` or
``"landlock"``) and what held, per call.
"""

from __future__ import annotations

import io
import json
import os
import re
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .cgroup import Cgroup
from .tools import RESULT_CHARS

NOBODY = 65534  # the sandbox's uid and gid
GRACE_S = 0.5  # after the code's wall limit: time to hand back its files, then teardown
STATUS_BYTES = 4096  # the bootstrap's status line on the files pipe


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 5.0
    cpu_s: int = 2  # per process
    memory_bytes: int = 512 * 2**20  # per process; with a cgroup also the whole tree
    file_bytes: int = 2**20  # largest file the code may write
    disk_bytes: int = 64 * 2**20  # all files in the sandbox directory together
    processes: int = 64  # the whole tree
    open_files: int = 64
    output_chars: int = RESULT_CHARS


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int | None  # None: killed at the wall-clock limit
    timed_out: bool
    enforced: dict = field(default_factory=dict)  # {"sandbox": ..., "network": ..., ...}

    def text(self) -> str:
        """What the model reads: stdout, then stderr, then how it ended if not cleanly."""
        parts = [self.stdout.rstrip(), self.stderr.rstrip()]
        if self.timed_out:
            parts.append("error: timeout")
        elif self.returncode:
            parts.append(f"exit status {self.returncode}")
        return "\n".join(p for p in parts if p)


# First in the sandbox: where bwrap ran privileged (the run is root), the init gives the
# tmpfs to 65534, empties its capability bounding set and becomes 65534, which leaves it no
# permitted or effective capability; either way it is 65534 after, and it clears the
# inheritable set (capset version 3: effective, permitted, inheritable all 0).
_DROP = f"""
import ctypes, os
libc = ctypes.CDLL(None)
if os.getuid() == 0:
    os.chown("/sandbox", {NOBODY}, {NOBODY})
    for cap in range(int(open("/proc/sys/kernel/cap_last_cap").read()) + 1):
        assert libc.prctl(24, cap, 0, 0, 0) == 0  # PR_CAPBSET_DROP
    os.setgroups([])
    os.setgid({NOBODY})
    os.setuid({NOBODY})
assert libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()) == 0
assert os.getuid() == {NOBODY} and os.getgid() == {NOBODY}
"""
# Then PID 1 of the sandbox (the kernel ignores signals from the code to it): says who it is
# (its uid, and the uid that this uid is outside: /proc/self/uid_map) on the files pipe, unpacks
# the files (a tar in a memory file), runs the code with its rlimits in a forked child (one
# interpreter start, not two), kills every other process of the namespace when the code
# ends or at the deadline, then writes its status line and a tar of /sandbox to the files
# pipe, which the code does not inherit and, this process being non-dumpable, cannot open
# through /proc.
_INIT = r"""
import ctypes, json, resource, select, sys, tarfile, time
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
files_in, files_out, deadline, nproc, cpu, mem, fsize, nofile = json.loads(sys.argv[1])
for fd in os.listdir("/proc/self/fd"):
    if int(fd) > 2 and int(fd) not in (files_in, files_out):
        os.closerange(int(fd), int(fd) + 1)
uid = os.getuid()
outside = [uid - int(inner) + int(outer) for inner, outer, n in
           map(str.split, open("/proc/self/uid_map")) if int(inner) <= uid < int(inner) + int(n)]
os.write(files_out, json.dumps({"uid": uid, "outside": outside[0]}).encode() + b"\n")
with os.fdopen(files_in, "rb") as files, tarfile.open(fileobj=files, mode="r|") as tar:
    tar.extractall("/sandbox", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
def limit():
    for res, n in ((resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_CPU, cpu),
                   (resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, fsize),
                   (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_CORE, 0)):
        if n is not None:
            resource.setrlimit(res, (n, n + 1 if res == resource.RLIMIT_CPU else n))
source = open("main.py").read()
pid = os.fork()
if pid == 0:  # the code: dumpable again (its own /proc is its own), no files pipe
    os.close(files_out)
    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)
    limit()
    sys.argv = ["main.py"]
    exec(compile(source, "main.py", "exec"), {"__name__": "__main__"})
    sys.exit(0)
exited = select.select([os.pidfd_open(pid)], [], [], max(0.0, deadline - time.monotonic()))[0]
rc, timed_out = (os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), False) if exited else \
    (None, True)
try:
    os.kill(-1, 9)
except ProcessLookupError:
    pass
with os.fdopen(files_out, "wb") as out:
    out.write(json.dumps({"returncode": rc, "timed_out": timed_out}).encode() + b"\n")
    with tarfile.open(fileobj=out, mode="w|") as tar:
        for name in sorted(os.listdir("/sandbox")):
            tar.add(os.path.join("/sandbox", name), arcname=name)
"""


def _mounts() -> list[str]:
    """bwrap arguments for the read-only system: /usr, the top-level links or directories
    into it, the Python installation and the few /etc files programs need (the directories
    above a bound one are made 0755 in the sandbox, whatever they are on the host)."""
    args: list[str] = []
    binds = ["/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            binds.append(top)
    binds += [f"/etc/{etc}" for etc in ("ld.so.cache", "ld.so.conf", "ld.so.conf.d",
                                         "alternatives", "localtime")
              if os.path.exists(f"/etc/{etc}")]
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                str(Path(sys.executable).resolve().parent.parent)}
    binds += sorted(p for p in prefixes if not p.startswith("/usr/") and p not in ("/", "/usr"))
    above = {str(d) for b in binds for d in Path(b).parents if str(d) != "/"}
    for d in sorted(above - set(binds), key=lambda d: d.count("/")):
        args += ["--perms", "0755", "--dir", d]
    for b in binds:
        args += ["--ro-bind", b, b]
    return args


def _bwrap(*command: str, disk_bytes: int) -> list[str]:
    """The bwrap command line. As root, bwrap runs privileged (no user namespace) keeping
    only what the init needs to drop to uid 65534 itself; otherwise a user namespace maps
    65534 onto the run's uid."""
    bwrap = shutil.which("bwrap")
    assert bwrap is not None  # _works() found it
    if os.geteuid() == 0:
        who = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
               "--unshare-cgroup-try", "--cap-drop", "ALL", "--cap-add", "CAP_SETUID",
               "--cap-add", "CAP_SETGID", "--cap-add", "CAP_CHOWN", "--cap-add", "CAP_SETPCAP"]
    else:
        who = ["--unshare-all", "--uid", str(NOBODY), "--gid", str(NOBODY)]
    mounts = _mounts()
    # /tmp is the sandbox, unless the Python installation lives below it (a venv in a
    # checkout under /tmp): then /tmp holds that read-only bind and TMPDIR alone says where
    tmp = [] if "/tmp" in mounts else ["--symlink", "/sandbox", "/tmp"]
    return [bwrap, *who, "--die-with-parent", "--new-session", "--as-pid-1", *mounts,
            "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev", "--perms", "0700",
            "--size", str(disk_bytes), "--tmpfs", "/sandbox", *tmp, "--remount-ro", "/",
            "--chdir", "/sandbox", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/sandbox",
            "--setenv", "TMPDIR", "/sandbox", "--setenv", "LANG", "C.UTF-8", *command]


def _works() -> bool:
    """Whether bwrap makes its namespaces here (probed once per process)."""
    if not _PROBE:
        ok = False
        if shutil.which("bwrap") and sys.platform == "linux":
            try:
                cmd = _bwrap(sys.executable, "-I", "-c", _DROP, disk_bytes=2**20)
                ok = subprocess.run(cmd, capture_output=True, timeout=10).returncode == 0
            except (OSError, subprocess.SubprocessError):
                ok = False
        _PROBE.append(ok)
    return _PROBE[0]


_PROBE: list[bool] = []


def _read_bounded(pipes: dict[int, int], deadline: float) -> tuple[dict[int, bytes], bool]:
    """Read the pipes ``{fd: most bytes kept}`` until each is at EOF or ``deadline``; bytes
    past a pipe's bound are read and dropped. Returns the bytes and whether all hit EOF."""
    kept = {fd: bytearray() for fd in pipes}
    sel = selectors.DefaultSelector()
    for fd in pipes:
        sel.register(fd, selectors.EVENT_READ)
    open_fds = set(pipes)
    while open_fds and (left := deadline - time.monotonic()) > 0:
        for key, _ in sel.select(left):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fd)
                open_fds.discard(key.fd)
            elif len(kept[key.fd]) < pipes[key.fd]:
                kept[key.fd] += chunk[: pipes[key.fd] - len(kept[key.fd])]
    sel.close()
    return {fd: bytes(b) for fd, b in kept.items()}, not open_fds


def _unpack(stream: bytes, home: Path) -> bool:
    """Replace ``home``'s contents by the regular files and directories of the tar
    ``stream``; names that leave the directory, links and devices are skipped. False (and
    ``home`` untouched) when the stream is not a whole tar."""
    entries: list[tuple[tuple[str, ...], bytes | None]] = []
    try:
        with tarfile.open(fileobj=io.BytesIO(stream), mode="r|") as tar:
            for member in tar:
                parts = Path(member.name).parts
                if parts and not member.name.startswith("/") and ".." not in parts:
                    if member.isdir():
                        entries.append((parts, None))
                    elif member.isfile():
                        entries.append((parts, tar.extractfile(member).read()))
    except tarfile.TarError:
        return False
    for child in home.iterdir():
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    for parts, data in entries:
        target = home.joinpath(*parts)
        if data is None:
            target.mkdir(mode=0o700, exist_ok=True)
        elif target.parent.is_dir() and not target.parent.is_symlink():
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
    return True


def _pack(home: Path) -> int:
    """A memory file holding a tar of ``home``'s contents, at offset 0."""
    fd = os.memfd_create("sandbox-files")
    with os.fdopen(os.dup(fd), "wb") as out, tarfile.open(fileobj=out, mode="w|") as tar:
        for child in sorted(home.iterdir()):
            tar.add(child, arcname=child.name)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _user(who_line: bytes) -> str:
    """``enforced["user"]`` from the init's first line: its uid, and the uid outside where a
    user namespace maps it to another."""
    if not who_line.startswith(b"{"):
        return "unknown (the sandbox ended before its init said)"
    who = json.loads(who_line)
    if who["outside"] == who["uid"]:
        return str(who["uid"])
    return f"{who['uid']} in a user namespace (uid {who['outside']} outside)"


def _run_bwrap(home: Path, limits: SandboxLimits) -> SandboxResult:
    deadline = time.monotonic() + limits.wall_s
    group = Cgroup.make(limits.memory_bytes + limits.disk_bytes, limits.processes)
    nproc = None if group else limits.processes
    files_r, files_w = os.pipe()
    files_in = _pack(home)
    init = [files_in, files_w, deadline, nproc, limits.cpu_s, limits.memory_bytes,
            limits.file_bytes, limits.open_files]
    cmd = _bwrap(sys.executable, "-I", "-c", _DROP + _INIT, json.dumps(init),
                 disk_bytes=limits.disk_bytes)
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, pass_fds=(files_w, files_in),
                                preexec_fn=group.enter if group else None,
                                start_new_session=True)
    finally:
        os.close(files_w)
        os.close(files_in)
    cut = limits.output_chars
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    files_cap = STATUS_BYTES + 2 * limits.disk_bytes + 2**20  # tar headers of small files
    got, done = _read_bounded({out_fd: 4 * cut, err_fd: 4 * cut, files_r: files_cap},
                              deadline + GRACE_S)
    os.killpg(proc.pid, signal.SIGKILL)  # bwrap: with it goes the PID namespace's init
    proc.wait()
    if group is not None:
        group.destroy()
    for f in (proc.stdout, proc.stderr):
        f.close()
    os.close(files_r)
    who_line, _, rest = got[files_r].partition(b"\n")
    status_line, _, tar = rest.partition(b"\n")
    status = json.loads(status_line) if done and status_line.startswith(b"{") else None
    stderr = got[err_fd].decode(errors="replace")[:cut]
    if status is not None and not (len(got[files_r]) < files_cap and _unpack(tar, home)):
        lost = "\nerror: the sandbox's files were too many to keep; it is as before the call"
        stderr = stderr[: cut - len(lost)] + lost
    enforced = {"sandbox": "bubblewrap", "user": _user(who_line),
                "network": "namespace", "writes": "tmpfs",
                "limits": "cgroup" if group else "rlimit"}
    timed_out = status is None or status["timed_out"]
    return SandboxResult(got[out_fd].decode(errors="replace")[:cut], stderr,
                         None if timed_out else status["returncode"], timed_out, enforced)


# ---------------------------------------------------------------- the fallback
#
# The run's own user in a child process: ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE``,
# ``RLIMIT_NOFILE``, ``RLIMIT_NPROC``, no core dumps; writes only inside the sandbox directory
# by Landlock (Linux >= 5.13) where available, reading stays allowed; network: an empty
# network namespace (``unshare --net --map-root-user``) where user namespaces are allowed,
# Landlock ABI >= 4 also refuses TCP bind and connect, else a Python preamble refuses to
# create sockets, which ctypes or a subprocess get around. ``enforced`` says which held.


# Runs first in the child: reads the code, restricts writes with Landlock (and TCP when the
# ABI has it), or falls back to refusing sockets in Python; then runs the code.
_BOOTSTRAP = r"""
import ctypes, json, os, sys
code = open("main.py").read()
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
status = {"writes": "none", "network": os.environ.pop("RLHFLESS_NETNS", "none")}
abi = libc.syscall(444, None, 0, 1)
if abi >= 1:
    write = 1 << 1 | sum(1 << b for b in range(4, 13))
    write |= (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)
    net = 3 if abi >= 4 else 0
    attr = (ctypes.c_uint64 * 2)(write, net)
    fd = libc.syscall(444, ctypes.byref(attr), 16 if net else 8, 0)
    home = os.open(".", os.O_PATH)
    rule = ctypes.create_string_buffer(write.to_bytes(8, "little")
                                       + home.to_bytes(4, "little", signed=True), 12)
    ok = fd >= 0 and libc.syscall(445, fd, 1, rule, 0) == 0
    ok = ok and libc.prctl(38, 1, 0, 0, 0) == 0 and libc.syscall(446, fd, 0) == 0
    if ok:
        status["writes"] = "landlock"
        if net:
            status["network"] = "+".join(s for s in (status["network"], "landlock-tcp")
                                         if s != "none")
if status["network"] == "none":
    import socket
    def _refuse(*a, **k):
        raise PermissionError("network access is disabled in this sandbox")
    socket.socket = socket.create_connection = socket.socketpair = _refuse
    status["network"] = "python-preamble"
sys.stderr.write("\x00SANDBOX " + json.dumps(status) + "\n")
sys.stderr.flush()
del ctypes, libc
exec(compile(code, "main.py", "exec"), {"__name__": "__main__"})
"""
_STATUS = re.compile(r"\x00SANDBOX (\{.*?\})\n")


def _netns_prefix() -> list[str]:
    """``unshare`` into an empty network namespace, where user namespaces are allowed."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    probe = subprocess.run([unshare, "--net", "--map-root-user", "true"],
                           capture_output=True, timeout=10)
    return [unshare, "--net", "--map-root-user"] if probe.returncode == 0 else []


_NETNS: list[list[str]] = []  # probed once per process


def _limit(limits: SandboxLimits) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def _run_landlocked(home: Path, limits: SandboxLimits) -> SandboxResult:
    """The fallback layer: the run's own user, Landlock, rlimits and a network namespace
    where each is available (``enforced`` says which held)."""
    if not _NETNS:
        _NETNS.append(_netns_prefix())
    prefix = _NETNS[0]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "TMPDIR": str(home), "LANG": "C.UTF-8",
           "RLHFLESS_NETNS": "namespace" if prefix else "none"}
    deadline = time.monotonic() + limits.wall_s
    proc = subprocess.Popen([*prefix, sys.executable, "-I", "-c", _BOOTSTRAP], cwd=home,
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=_limit(limits),
                            start_new_session=True)
    cut = limits.output_chars
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    got, _ = _read_bounded({out_fd: 4 * cut, err_fd: 4 * cut + STATUS_BYTES}, deadline)
    try:
        proc.wait(max(0.0, deadline - time.monotonic()))
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for f in (proc.stdout, proc.stderr):
        f.close()
    stderr = got[err_fd].decode(errors="replace")
    found = _STATUS.search(stderr)
    enforced = json.loads(found.group(1)) if found else {}  # the first line: ours, before the code
    enforced = {"sandbox": "landlock", "user": "the run's", "limits": "rlimit", **enforced}
    stderr = stderr[found.end():] if found else stderr
    return SandboxResult(got[out_fd].decode(errors="replace")[:cut], stderr[:cut],
                         None if timed_out else proc.returncode, timed_out, enforced)


def run_python(code: str, sandbox: str | os.PathLike[str],
               limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` confined to the directory ``sandbox`` (created if needed); see the
    module docstring for what is enforced."""
    home = Path(sandbox).resolve()
    home.mkdir(parents=True, exist_ok=True)
    (home / "main.py").write_text(code)
    if _works():
        return _run_bwrap(home, limits)
    return _run_landlocked(home, limits)
