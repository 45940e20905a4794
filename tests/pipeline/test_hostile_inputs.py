"""Red-team probes of the command line, run as a hostile or careless user would: each ends
in one line on stderr, a non-zero exit and no traceback, and changes nothing outside the run
directory it names (a snapshot of the whole temporary tree is compared before and after).

The probes that must not start a run are ``main(argv)`` calls in this process; the lock
probes hold a run in a second, real process (``HOLDER``) and kill it with SIGKILL.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rlhfless.pipeline.cli import main
from rlhfless.pipeline.config import Config
from rlhfless.pipeline.durable.recovery import open_run, resume_config
from rlhfless.pipeline.durable.runs import MARKER, RunDir


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


def test_overwrite_with_a_bad_dataset_keeps_the_old_run_byte_for_byte(tree, capsys,
                                                                      tiny_model_dir):
    """The new run fails on its data, after its directory was made: the old run's files
    were gone. Now every path is as it was (content, mode, mtime), but for the mtime of
    runs/ itself, in which the old run was renamed aside and back."""
    old = tree / "runs" / "keep"
    (old / "rollouts" / "iter-00001.parquet").write_bytes(b"old rollouts")
    (old / "checkpoints" / "iter-00001").mkdir(parents=True)
    (old / "checkpoints" / "iter-00001" / "COMMITTED").write_text("{}")
    (tree / "empty.jsonl").write_text("")
    before = snapshot(tree)
    err = one_line_error(capsys, ["train", "--set", "name='keep'", "--overwrite", "--set",
                                  "dataset='empty.jsonl'", "--set", f"model='{tiny_model_dir}'"])
    assert "empty.jsonl" in err and "no prompts" in err, err
    after = snapshot(tree)
    assert after.pop("runs")[:2] == before.pop("runs")[:2]
    assert after == before


def test_an_existing_run_is_not_replaced_without_overwrite(tree, capsys):
    before = snapshot(tree)
    err = one_line_error(capsys, ["train", "--set", "name='keep'"])
    assert err == ("rlhfless: run directory runs/keep exists; choose another name "
                   "(--set name=...) or pass --overwrite")
    assert snapshot(tree) == before


HOLDER = textwrap.dedent("""
    import sys, time
    from rlhfless.pipeline.config import Config
    from rlhfless.pipeline.durable.runs import RunDir
    run = RunDir.create(Config(runs_dir="runs", name="live"))
    run.append_metrics({"event": "iteration", "iteration": 1})  # started: not to be replaced
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


def cli_as_another_user(cwd: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """The CLI in a subprocess; as root, as user nobody (root may write anywhere)."""
    prefix = (["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
              if os.geteuid() == 0 else [])
    return subprocess.run([*prefix, sys.executable, "-m", "rlhfless.pipeline.cli", *argv],
                          cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HOME": str(cwd)})


@pytest.mark.parametrize("argv, message", [
    (["--set", "dataset='missing.jsonl'"],
     "config error: dataset = 'missing.jsonl': no such file; give the path of a .jsonl"),
    (["--set", "heldout='precious'"],
     "config error: heldout = 'precious' is a directory; give a .jsonl, .json or .parquet"),
    (["precious"], "config error: config file precious is a directory; give a TOML file"),
    (["--set", "model='precious'"],
     "config error: model = 'precious': no Hugging Face config.json there"),
    (["--set", "rewards={tally='no_such_module:score'}"],
     "config error: rewards.tally = 'no_such_module:score' does not import "
     "(ModuleNotFoundError: No module named 'no_such_module'); give a verifier"),
    (["--set", "rewards={tally='broken_reward:score'}"],
     "config error: rewards.tally = 'broken_reward:score' does not import (ZeroDivisionError"),
    (["--set", "rewards={tally='good_reward:nothing'}"],
     "config error: rewards.tally = 'good_reward:nothing' does not import (AttributeError"),
    (["--set", "rewards={tally='good_reward:CONSTANT'}"],
     "config error: rewards.tally = 'good_reward:CONSTANT' is a float, not a function"),
    (["--set", "default_reward='good_reward:score'"],
     "config error: default_reward = 'good_reward:score' is not a verifier"),
    (["--set", "agent='https://127.0.0.1:9/episode'", "--set", "agent_ca_file='ca.pem'"],
     "config error: agent_ca_file = 'ca.pem' cannot be read: No such file or directory"),
    (["--set", "agent='https://127.0.0.1:9/episode'",
      "--set", "agent_ca_file='good_reward.py'"],
     "config error: agent_ca_file = 'good_reward.py' holds no PEM certificate"),
    (["--set", "agent='tally-agent'", "--set", "agent_ca_file='good_reward.py'"],
     "config error: agent_ca_file = 'good_reward.py' is the authority of an https:// agent "
     "service; agent = 'tally-agent' is none"),
    (["--set", "runs_dir='precious/thesis.tex/runs'"],
     "cannot create run directory precious/thesis.tex/runs/fresh: Not a directory; choose a "
     "writable runs_dir"),
])
def test_bad_inputs_fail_in_one_line_before_anything_is_written(tree, capsys, argv, message):
    (tree / "broken_reward.py").write_text("1 / 0\n")
    (tree / "good_reward.py").write_text("CONSTANT = 0.5\n\ndef score(text, answer):\n"
                                         "    return 1.0\n")
    before = snapshot(tree)
    err = one_line_error(capsys, ["train", *argv, "--set", "name='fresh'"])
    assert err.startswith(f"rlhfless: {message}"), err
    assert {k: v for k, v in snapshot(tree).items() if "__pycache__" not in k} == before


def test_debug_shows_the_traceback(tree):
    with pytest.raises(Exception, match="no such file"):
        main(["train", "--debug", "--set", "dataset='missing.jsonl'"])


def test_unwritable_runs_dir_is_one_line(tree):
    (tree / "runs").chmod(0o755)  # owned by this user: another cannot write there
    before = snapshot(tree)
    done = cli_as_another_user(tree, ["train", "--set", "name='fresh'"])
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == ("rlhfless: cannot create run directory runs/fresh: "
                                   "Permission denied; choose a writable runs_dir "
                                   "(--set runs_dir=...)"), done.stderr
    assert snapshot(tree) == before


def test_graph_into_a_missing_folder_is_one_line(tree, capsys):
    before = snapshot(tree)
    err = one_line_error(capsys, ["graph", "-o", "no/such/folder/graph.png"])
    assert err.startswith("rlhfless: config error: graph -o no/such/folder/graph.png: the "
                          "folder ") and err.endswith("does not exist; create it or choose "
                                                      "another path")
    assert snapshot(tree) == before


def test_a_run_that_fails_before_its_first_iteration_does_not_block_a_rerun(tree, capsys):
    (tree / "bad.jsonl").write_text('{"prompt": "1 2", "answer": "2"}\nnot json\n')
    argv = ["train", "--set", "dataset='bad.jsonl'", "--set", "name='early'"]
    first = one_line_error(capsys, argv)
    assert "bad.jsonl" in first and "line 2" in first, first
    assert one_line_error(capsys, argv) == first  # not "runs/early exists"
    assert sorted(p.name for p in (tree / "runs").iterdir()) == ["early", "keep", "not-a-run"]


@pytest.mark.slow
def test_a_reward_module_in_the_working_directory_reaches_the_workers(tree, tiny_model_dir):
    """The ``rlhfless`` script (not ``python -m``): the working directory is not on its
    ``sys.path`` until the driver puts it there, and the workers score with the module."""
    (tree / "half_reward.py").write_text("def score(text, answer):\n    return 0.5\n")
    script = Path(sys.executable).with_name("rlhfless")
    done = subprocess.run(
        [str(script), "train", "--no-progress", "--set", "name='cwd'", "--set",
         f"model='{tiny_model_dir}'", "--set", "rewards={tally='half_reward:score'}",
         *[f"--set={kv}" for kv in ("iterations=1", "batch_prompts=4", "n_samples=2",
                                    "max_new_tokens=8", "heldout_prompts=4", "eval_every=1")]],
        cwd=tree, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rewards = pq.read_table(tree / "runs" / "cwd" / "rollouts" / "iter-00001.parquet")
    assert set(rewards.column("reward").to_pylist()) == {0.5}


@pytest.fixture
def resumable(finished_run, tree) -> Path:
    """A copy of a finished two-iteration run (checkpoints included) in ``tree``."""
    shutil.copytree(finished_run, tree / "runs" / "finished")
    return Path("runs/finished")


def test_resume_refuses_a_changed_setting_before_touching_the_run(tree, capsys, resumable):
    before = snapshot(tree)
    err = one_line_error(capsys, ["train", "--resume", str(resumable), "--set", "lr=1e-3",
                                  "--set", "iterations=4", "--set", "n_samples=4"])
    assert err.startswith("rlhfless: cannot resume: runs/finished cannot continue with "
                          "n_samples (3 -> 4), lr (0.0005 -> 0.001) changed; a resumed run may "
                          "change only iterations, max_wall_s, eval_every"), err
    assert snapshot(tree) == before


def test_an_accepted_change_on_resume_is_recorded_old_and_new(tree, resumable):
    cfg = resume_config(resumable, ["iterations=4", "eval_every=2", "lr=5e-4"])
    open_run(cfg, resume=True).release()
    changes = RunDir(resumable).read_jsonl("config_changes.jsonl")
    assert [c["changes"] for c in changes] == [
        {"iterations": {"old": 2, "new": 4}, "eval_every": {"old": 1, "new": 2}}]
    assert changes[0]["resumed_from"] == "iter-00002"
    saved = RunDir(resumable).read_json("config.json")
    assert (saved["iterations"], saved["eval_every"]) == (4, 2)


@pytest.mark.parametrize("value, message", [
    ("worker_memory=lots", "config error: worker_memory = 'lots' is not a size: use a size of "
                           "at least 512 MiB per worker, such as '4GiB' or '2000MB'"),
    ("worker_memory='1kB'", "config error: worker_memory = '1kB' is 1000 bytes, too little"),
    ("worker_lifetime='1e400s'", "config error: worker_lifetime = '1e400s': use a duration"),
])
def test_bad_sizes_and_durations_fail_before_the_cluster_starts(tree, value, message):
    """Once a worker with a bad memory limit started, the run hung for minutes in hundreds of
    tracebacks; the value is refused in one line before anything starts or is written."""
    before = snapshot(tree)
    done = subprocess.run([sys.executable, "-m", "rlhfless.pipeline.cli", "train", "--set",
                           value, "--set", "name='fresh'"], cwd=tree, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"rlhfless: {message}"), done.stderr
    assert done.stderr.count("\n") == 1 and not done.stdout, done.stderr
    assert snapshot(tree) == before


def no_file_over_1_mib() -> None:
    """A disk that takes no file over 1 MiB (the write fails, EFBIG, as on a full disk): the
    tiny model's weights (3.4 MB) cannot be published."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


@pytest.mark.slow
def test_a_task_that_fails_ends_the_run_in_one_line(tiny_model_dir, tmp_path):
    """The publish task fails on the trainer; the run ends in the one line of the CLI, not
    after Dask's "Compute Failed" block with the task's traceback (nor a nanny's warnings)."""
    cmd = [sys.executable, "-m", "rlhfless.pipeline.cli", "train", "--no-progress"]
    for s in (f"model='{tiny_model_dir}'", "name='full'", "iterations=1", "batch_prompts=4",
              "n_samples=2", "max_new_tokens=8", "heldout_prompts=4", "gen_workers=1",
              "train_threads=1"):
        cmd += ["--set", s]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          preexec_fn=no_file_over_1_mib)
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "File too large" in lines[0], done.stderr
    assert lines[0].startswith("rlhfless: unexpected ") and "Compute Failed" not in done.stderr
