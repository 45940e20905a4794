"""Red-team probes of the command line, run as a hostile or careless user would: each ends
in one line on stderr, a non-zero exit and no traceback, and changes nothing outside the run
directory it names (a snapshot of the whole temporary tree is compared before and after).

The probes that must not start a run are ``main(argv)`` calls in this process; the lock
probes hold a run in a second, real process (``HOLDER``) and kill it with SIGKILL.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlhfless.pipeline.cli import main
from rlhfless.pipeline.config import Config
from rlhfless.pipeline.runs import MARKER, RunDir


def snapshot(root: Path) -> dict[str, tuple]:
    """Every path under ``root`` with its kind, size, mtime and (files) content."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        content = path.read_bytes() if path.is_file() and not path.is_symlink() else None
        out[str(path.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, content)
    return out


def one_line_error(capsys, argv: list[str], code: int = 2) -> str:
    """Run the CLI; assert the exit code and a single stderr line without a traceback."""
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlhfless: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """A working directory with a finished-looking run, a directory that is not a run and
    a precious file beside runs/."""
    monkeypatch.chdir(tmp_path)
    keep = RunDir.create(Config(runs_dir="runs", name="keep"))
    keep.append_metrics({"event": "iteration", "iteration": 1})
    keep.release()
    (tmp_path / "runs" / "not-a-run").mkdir()
    (tmp_path / "runs" / "not-a-run" / "data.txt").write_text("mine")
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "thesis.tex").write_text("do not delete")
    return tmp_path


@pytest.mark.parametrize("name", ["", ".", "..", "../precious", "runs/keep", "/tmp",
                                  "a b", "-rf", ".hidden", "x" * 200, "ünï"])
def test_unsafe_run_names_are_refused_and_overwrite_touches_nothing(tree, capsys, name):
    before = snapshot(tree)
    err = one_line_error(capsys, ["train", "--set", f"name={name!r}", "--overwrite"])
    assert err.startswith(f"rlhfless: config error: name = {name!r} is not allowed"), err
    assert "one path component" in err
    assert snapshot(tree) == before


def test_overwrite_replaces_only_a_run_of_ours(tree, capsys):
    (tree / "runs" / "link").symlink_to(tree / "precious")
    before = snapshot(tree)
    err = one_line_error(capsys, ["train", "--set", "name='not-a-run'", "--overwrite"])
    assert "is not a run directory" in err and MARKER in err
    err = one_line_error(capsys, ["train", "--set", "name='link'", "--overwrite"])
    assert "is not a run directory" in err
    assert snapshot(tree) == before


def test_overwrite_renames_the_old_run_aside_and_leaves_nothing_of_it(tree):
    old = tree / "runs" / "keep"
    (old / "rollouts" / "iter-00001.parquet").write_bytes(b"old")
    run = RunDir.create(Config(runs_dir="runs", name="keep"), overwrite=True)
    run.release()
    assert sorted(p.name for p in old.iterdir()) == [".lock", MARKER, "config.json",
                                                     "rollouts"]
    assert not list((old / "rollouts").iterdir())
    assert sorted(p.name for p in (tree / "runs").iterdir()) == ["keep", "not-a-run"]
    assert (tree / "precious" / "thesis.tex").read_text() == "do not delete"


def test_an_existing_run_is_not_replaced_without_overwrite(tree, capsys):
    before = snapshot(tree)
    err = one_line_error(capsys, ["train", "--set", "name='keep'"])
    assert err == ("rlhfless: run directory runs/keep exists; choose another name "
                   "(--set name=...) or pass --overwrite")
    assert snapshot(tree) == before


HOLDER = textwrap.dedent("""
    import sys, time
    from rlhfless.pipeline.config import Config
    from rlhfless.pipeline.runs import RunDir
    run = RunDir.create(Config(runs_dir="runs", name="live"))
    print("ready", flush=True)
    time.sleep(600)
""")


def test_a_live_run_is_locked_against_a_second_process_until_it_dies(tree, capsys):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], cwd=tree, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        before = snapshot(tree)
        in_use = (f"rlhfless: run directory runs/live is in use by a live run (pid "
                  f"{holder.pid} on ")
        for argv in (["train", "--resume", "runs/live"],
                     ["train", "--set", "name='live'", "--overwrite"],
                     ["train", "--set", "name='live'"]):
            err = one_line_error(capsys, argv)
            assert err.startswith(in_use) or err.startswith(
                in_use.replace("rlhfless: ", "rlhfless: cannot resume: ")), err
        assert snapshot(tree) == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the kernel dropped the lock with the process: no stale lock
    err = one_line_error(capsys, ["train", "--resume", "runs/live"])
    assert "no whole checkpoint" in err, err
    RunDir.create(Config(runs_dir="runs", name="live"), overwrite=True).release()
