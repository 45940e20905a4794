"""Hostile code in the Python tool (ops/rollouts/sandbox.py): every escape found against the old
Landlock/rlimit tool (run as the run's own user) is refused or contained by the bubblewrap
sandbox, and the call ends before the code's own holds (its sleeps of ``HOLD_S``) would.

Each test would fail on the old tool: there the code ran as the run's user (root in CI),
saw the whole file system, shared the PID namespace and had per-process limits only. The
tests need the bubblewrap layer (and the memory test a cgroup); where it cannot run they
skip, except under ``RLHFLESS_REQUIRE_SANDBOX=1`` (``.ci/run`` sets it), where they fail."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rlhfless.ops.rollouts.sandbox import SandboxLimits, run_python

HOLD_S = 30  # how long the code below holds the call (its sleeps); every wall limit is < 10 s


def _unavailable(reason: str) -> None:
    """Skip, or fail under ``RLHFLESS_REQUIRE_SANDBOX=1``."""
    if os.environ.get("RLHFLESS_REQUIRE_SANDBOX") == "1":
        pytest.fail(f"RLHFLESS_REQUIRE_SANDBOX=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture
def box(tmp_path: Path) -> Path:
    """A sandbox directory, after checking that the bubblewrap layer is the one that runs."""
    first = run_python("pass", tmp_path / "box")
    if first.enforced.get("sandbox") != "bubblewrap":
        _unavailable(f"the bubblewrap sandbox is unavailable here (ran {first.enforced})")
    return tmp_path / "box"


def _timed(code: str, box: Path, limits: SandboxLimits):
    """Run ``code`` and check that the call ended before the code's holds could: a hold
    (a sleep of ``HOLD_S``, a child holding the output pipe through one) starts after the
    call did, so a call that waited for it ends ``HOLD_S`` or more after its start. An order,
    not a margin on the teardown: only a stall of ``HOLD_S - wall_s`` could break it."""
    assert limits.wall_s < HOLD_S
    start = time.monotonic()
    out = run_python(code, box, limits)
    assert time.monotonic() - start < HOLD_S, out
    return out


def _running(marker: str) -> list[int]:
    """Pids whose command line holds ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run directory as the driver leaves it: 0700 TLS directory with a 0600 key."""
    tls = tmp_path / "runs" / "r" / "tls"
    tls.mkdir(parents=True)
    tls.chmod(0o700)
    key = tls / "node.key"
    key.write_text("SECRET KEY")
    key.chmod(0o600)
    return tmp_path / "runs"


def test_chmod_of_the_run_and_of_the_system_refused(box, run_dir):
    tls, key = run_dir / "r" / "tls", run_dir / "r" / "tls" / "node.key"
    system = Path(sys.executable).resolve()
    before = {p: p.stat().st_mode for p in (run_dir, tls, key, system)}
    code = "\n".join([
        "import os",
        f"for path, mode in (({str(tls)!r}, 0o755), ({str(key)!r}, 0o644),",
        f"                   ({str(run_dir)!r}, 0o777), ({str(key)!r}, 0o4755),",
        f"                   ({str(system)!r}, {before[system] & 0o7777})):",
        "    try:",
        "        os.chmod(path, mode)",
        "        print('changed', path)",
        "    except OSError as err:",
        "        print('refused', path, type(err).__name__)",
    ])
    out = _timed(code, box, SandboxLimits())
    assert "changed" not in out.stdout and out.stdout.count("refused") == 5, out
    assert {p: p.stat().st_mode for p in before} == before


def test_the_run_files_and_shadow_unreadable(box, run_dir):
    key = run_dir / "r" / "tls" / "node.key"
    code = "\n".join([
        f"for path in ({str(key)!r}, '/etc/shadow', '/etc/passwd'):",
        "    try:",
        "        print('read', path, open(path).read()[:20])",
        "    except OSError as err:",
        "        print('refused', path, type(err).__name__)",
        "import os",
        f"print('listing', os.path.exists({str(run_dir)!r}))",
    ])
    out = _timed(code, box, SandboxLimits())
    assert "SECRET" not in out.stdout and "read " not in out.stdout, out
    assert out.stdout.count("refused") == 3 and "listing False" in out.stdout


def test_signals_do_not_reach_the_driver(box):
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        code = "\n".join([
            "import os, signal",
            f"for pid in ({driver.pid}, {os.getpid()}):",
            "    try:",
            "        os.kill(pid, signal.SIGKILL)",
            "        print('killed', pid)",
            "    except OSError as err:",
            "        print('refused', pid, type(err).__name__)",
        ])
        out = _timed(code, box, SandboxLimits())
        time.sleep(0.2)  # a SIGKILL that got through has been delivered by now
        assert driver.poll() is None and out.stdout.count("refused") == 2, out
    finally:
        driver.kill()
        driver.wait()


def test_a_fork_bomb_is_held_to_the_process_limit(box):
    marker = f"bomb-{uuid.uuid4().hex}"
    limits = SandboxLimits(processes=16, wall_s=5)
    code = "\n".join([
        "import os, sys",
        "n = 0",
        "try:",
        "    for _ in range(200):",
        "        if os.fork() == 0:",
        f"            os.execv(sys.executable, [sys.executable, '-c',"
        f" 'import time; time.sleep(30)', {marker!r}])",
        "        n += 1",
        "except OSError:",
        "    pass",
        "print('forked', n)",
    ])
    out = _timed(code, box, limits)
    assert out.stdout.startswith("forked "), out
    assert int(out.stdout.split()[1]) < limits.processes
    assert _running(marker) == []


def test_memory_is_limited_across_children(box):
    limits = SandboxLimits(memory_bytes=128 * 2**20, disk_bytes=16 * 2**20, wall_s=8)
    each = 64 * 2**20
    # every child holds its block until each of them has it or was killed, however slowly
    # a loaded machine schedules them; those that print "released" held theirs all at once
    # (one killed after it said "held" does not), so the count does not depend on timing
    code = "\n".join([
        "import os, select",
        "release_r, release_w = os.pipe()",
        "ready_r, ready_w = os.pipe()",
        "kids = []",
        "for _ in range(6):",
        "    pid = os.fork()",
        "    if pid == 0:",
        "        os.close(release_w)",
        f"        block = b'x' * {each}",
        "        print('held', flush=True)",
        "        os.write(ready_w, b'1')",
        "        os.read(release_r, 1)",
        "        print('released', flush=True)",
        "        os._exit(0)",
        "    kids.append(pid)",
        "ready, dead = 0, set()",
        "while ready + len(dead) < len(kids):",
        "    if select.select([ready_r], [], [], 0.05)[0]:",
        "        ready += len(os.read(ready_r, 64))",
        "    dead |= {p for p in kids if p not in dead and os.waitpid(p, os.WNOHANG)[0]}",
        "os.close(release_w)",
        "for pid in kids:",
        "    if pid not in dead:",
        "        os.waitpid(pid, 0)",
    ])
    out = _timed(code, box, limits)
    if out.enforced["limits"] != "cgroup":
        _unavailable("no cgroup could be made here: memory is limited per process only")
    held_at_once = out.stdout.count("released")
    assert 1 <= held_at_once <= (limits.memory_bytes + limits.disk_bytes) // each, out
    # the call's cgroups (named after this process) went with it
    assert glob.glob(f"/sys/fs/cgroup/**/rlhfless-tool-{os.getpid()}-*", recursive=True) == []


def test_disk_writes_are_held_to_the_disk_limit(box):
    limits = SandboxLimits(disk_bytes=8 * 2**20, file_bytes=2**20)
    code = "\n".join([
        "written = 0",
        "try:",
        "    for i in range(40):",
        "        with open(f'f{i}', 'wb') as f:",
        f"            f.write(b'x' * {limits.file_bytes})",
        f"        written += {limits.file_bytes}",
        "except OSError as err:",
        "    print(type(err).__name__)",
        "print('written', written)",
    ])
    out = _timed(code, box, limits)
    assert "written" in out.stdout, out
    assert int(out.stdout.split()[-1]) <= limits.disk_bytes
    assert sum(p.stat().st_size for p in box.iterdir()) <= limits.disk_bytes


@pytest.mark.parametrize("holds_pipe", [False, True])
def test_no_child_outlives_the_call_or_holds_it(box, holds_pipe):
    marker = f"daemon-{uuid.uuid4().hex}"
    limits = SandboxLimits(wall_s=2)
    pipe = "None" if holds_pipe else "open('daemon.log', 'w')"
    code = "\n".join([
        "import subprocess, sys",
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)', {marker!r}],",
        f"                 start_new_session=True, stdout={pipe}, stderr={pipe})",
        "print('started', flush=True)",
    ])
    out = _timed(code, box, limits)
    assert out.stdout == "started\n" and out.returncode == 0, out
    assert _running(marker) == []


def test_a_sleep_returns_at_the_wall_limit(box):
    out = _timed("import time\ntime.sleep(30)", box, SandboxLimits(wall_s=1))
    assert out.timed_out and out.returncode is None


def test_files_come_back_but_links_out_do_not(box, run_dir):
    key = run_dir / "r" / "tls" / "node.key"
    code = "\n".join([
        "import os",
        "os.makedirs('d/e')",
        "open('d/e/kept.txt', 'w').write('kept')",
        f"os.symlink({str(key)!r}, 'key-link')",
        "os.symlink('/', 'root-link')",
    ])
    out = _timed(code, box, SandboxLimits())
    assert out.returncode == 0, out
    assert (box / "d" / "e" / "kept.txt").read_text() == "kept"
    assert not any(p.is_symlink() for p in box.rglob("*"))
    again = _timed("print(open('d/e/kept.txt').read())", box, SandboxLimits())
    assert again.stdout == "kept\n"


def _status(text: str) -> dict[str, str]:
    """The fields of a ``/proc/<pid>/status`` text."""
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def test_the_code_runs_as_nobody_with_no_privilege_to_gain(box):
    """Measured inside: the code's real, effective, saved and file-system uid and gid are 65534,
    it has no supplementary group, no capability, and no_new_privs (a setuid binary gives it
    nothing); ``enforced["user"]`` says the uid the sandbox measured."""
    out = _timed("print(open('/proc/self/status').read())", box, SandboxLimits())
    status = _status(out.stdout)
    assert status["Uid"].split() == status["Gid"].split() == ["65534"] * 4, out
    assert status["Groups"] == ""
    # as root the init emptied the bounding set too (a user namespace's is the namespace's)
    sets = ("CapInh", "CapPrm", "CapEff", "CapAmb") + (("CapBnd",) if os.geteuid() == 0 else ())
    assert {c: int(status[c], 16) for c in sets} == dict.fromkeys(sets, 0), out
    assert status["NoNewPrivs"] == "1"
    outside = "" if os.geteuid() == 0 else f" in a user namespace (uid {os.getuid()} outside)"
    assert out.enforced["user"] == f"65534{outside}"


def test_the_sandbox_init_is_not_dumpable(box):
    """The sandbox's init (PID 1) holds the pipe the files go back through. It is
    non-dumpable (as root its drop to 65534 makes it so, and its prctl keeps it so), so the
    code cannot open its descriptors or its memory through /proc, though it can its own; the
    init too is 65534 with no_new_privs. Made dumpable, it lets the code open both."""
    code = "\n".join([
        "import os",
        "print('own', len(os.listdir('/proc/self/fd')) > 0)",
        "for path in ('/proc/1/fd', '/proc/1/environ', '/proc/1/mem'):",
        "    try:",
        "        os.listdir(path) if path.endswith('fd') else open(path, 'rb').read(1)",
        "        print('opened', path)",
        "    except OSError as err:",
        "        print('refused', path, type(err).__name__)",
        "print(open('/proc/1/status').read())",
    ])
    out = _timed(code, box, SandboxLimits())
    assert out.stdout.startswith("own True\n"), out
    assert "opened" not in out.stdout and out.stdout.count("refused") == 3, out
    assert out.stdout.count("PermissionError") == 3
    init = _status(out.stdout)
    assert init["Uid"].split() == ["65534"] * 4 and init["NoNewPrivs"] == "1", out
