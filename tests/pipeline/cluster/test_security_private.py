"""A run is its user's own: its files 0600 and directories 0700 unless ``run_umask`` shares
them (files the trainer's worker process writes too), batch jobs write under the same umask,
and Dask's dashboard is off unless asked for; when on, it listens on loopback and its
``/sitemap.json`` answers without a traceback in the run's output."""

from __future__ import annotations

import json
import stat
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_security import POOLS, host_of

from rlhfless.pipeline.cluster.deploy import deployment_from_config
from rlhfless.pipeline.cluster.pools import PoolCluster
from rlhfless.pipeline.config import Config, ConfigError, load_config
from rlhfless.pipeline.train.loop import train
from rlhfless.schedulers.ledger import CostLedger


def modes(run: Path, leave_out: Path | None = None) -> tuple[set[int], set[int]]:
    """The permission bits of the files and of the directories under ``run`` (itself
    included), those under ``leave_out`` left out. A symbolic link is left out: its own bits
    mean nothing (W&B links its logs and the run's report into its run folder)."""
    files, dirs = set(), {stat.S_IMODE(run.stat().st_mode)}
    for path in run.rglob("*"):
        if leave_out is not None and path.is_relative_to(leave_out) or path.is_symlink():
            continue
        mode = path.lstat().st_mode
        (dirs if stat.S_ISDIR(mode) else files).add(stat.S_IMODE(mode))
    return files, dirs


def assert_private(run: Path) -> None:
    files, dirs = modes(run)
    assert files == {0o600} and dirs == {0o700}, (files, dirs)


def test_a_run_is_private_to_its_user_by_default(finished_run):
    assert (finished_run / "rollouts").is_dir() and any((finished_run / "checkpoints").iterdir())
    assert_private(finished_run)


@pytest.mark.slow
def test_run_umask_shares_a_run_read_only_but_not_its_key(tiny_model_dir, tmp_path):
    cfg = Config(model=str(tiny_model_dir), runs_dir=str(tmp_path), name="shared",
                 iterations=1, batch_prompts=2, n_samples=2, max_new_tokens=8,
                 heldout_prompts=2, gen_workers=1, train_threads=1, checkpoint_every=1,
                 run_umask=0o022)
    run = train(cfg, progress=False, log=lambda *_: None).path
    assert any((run / "checkpoints").iterdir())  # written by the trainer's worker process
    shared = {0o644: [], 0o755: []}
    for path in [run, *run.rglob("*")]:
        if not path.is_relative_to(run / "tls"):
            shared.setdefault(stat.S_IMODE(path.lstat().st_mode), []).append(path)
    assert set(shared) == {0o644, 0o755}, {oct(m): p[:3] for m, p in shared.items()}
    assert modes(run / "tls") == ({0o600}, {0o700})


def test_run_umask_is_checked():
    assert load_config(None, ["run_umask=0o022"]).run_umask == 0o022
    for bad in ("0o700", "0o177", "-1"):
        with pytest.raises(ConfigError, match="run_umask = .* must be a umask from 0o000 to"):
            load_config(None, [f"run_umask={bad}"])


def test_batch_jobs_write_under_the_run_umask(tmp_path):
    for given, line in (([], "umask 077\n"), (["run_umask=0o022"], "umask 022\n")):
        cfg = load_config(None, ["cluster='slurm'", *given])
        assert line in deployment_from_config(cfg, tmp_path).job_script(POOLS[0])


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=20) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as err:
        return err.code, b""


def test_the_dashboard_is_off_unless_asked(tmp_path):
    cfg = load_config(None, [f"runs_dir='{tmp_path}'"])
    with PoolCluster(POOLS, CostLedger(cfg.prices),
                     deployment=deployment_from_config(cfg, tmp_path)) as pc:
        assert pc.dashboard_link == ""
        port = pc.cluster.scheduler.http_server.port  # Dask always serves HTTP: health only
        assert get(port, "/health") == (200, b"ok")
        for page in ("/status", "/info/main/workers.html", "/json/counts.json"):
            assert get(port, page)[0] == 404, page


def test_a_dashboard_asked_for_is_on_loopback_and_its_sitemap_answers(tmp_path, capfd):
    cfg = load_config(None, [f"runs_dir='{tmp_path}'", "dashboard=true"])
    with PoolCluster(POOLS, CostLedger(cfg.prices),
                     deployment=deployment_from_config(cfg, tmp_path)) as pc:
        assert host_of(pc.dashboard_link) == "127.0.0.1"
        port = pc.cluster.scheduler.http_server.port
        assert get(port, "/status")[0] == 200
        status, body = get(port, "/sitemap.json")
        assert status == 200 and {"/status", "/health"} <= set(json.loads(body)["paths"])
    assert "Traceback" not in capfd.readouterr().err
