"""Faults on a LocalCluster with real worker processes and real SIGKILL.

Every faulty run is compared with one uninterrupted run of the same configuration and seeds
(``reference``): the same samples in every iteration, each (prompt, sample) exactly once,
and bitwise the same final weights.

* a generation worker killed mid-iteration: Dask recomputes its task, the nanny restarts it;
* the trainer killed mid-update: the run goes back to its last checkpoint by itself;
* the driver killed: ``rlhfless train --resume`` continues; the newest checkpoint, left
  partial on disk, is detected and the one before it used.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
import torch
from distributed.client import _get_global_client
from run_support import train_in_thread, wait_for
from safetensors.torch import load_file

from rlhfless.pipeline.cli import main
from rlhfless.pipeline.config import Config
from rlhfless.pipeline.train.loop import train

ITERATIONS = 3
ROLLOUT_COLUMNS = ["prompt_id", "sample_idx", "response_ids", "logprobs", "policy_version"]


@pytest.fixture(scope="module")
def base_cfg(tiny_model_dir, tmp_path_factory) -> Config:
    return Config(model=str(tiny_model_dir), runs_dir=str(tmp_path_factory.mktemp("runs")),
                  iterations=ITERATIONS, batch_prompts=4, n_samples=4, max_new_tokens=16,
                  heldout_prompts=4, eval_every=100, gen_workers=2, train_threads=1,
                  checkpoint_every=1, keep_checkpoints=2)


@pytest.fixture(scope="module")
def reference(base_cfg) -> Path:
    """An uninterrupted run."""
    return train(replace(base_cfg, name="reference"), progress=False, log=lambda *_: None).path


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "weights" / f"v{ITERATIONS}.safetensors")


def assert_same_run(run: Path, reference: Path) -> None:
    """Same samples, each exactly once, and bitwise the same final weights."""
    for it in range(1, ITERATIONS + 1):
        name = f"rollouts/iter-{it:05d}.parquet"
        got = pq.read_table(run / name, columns=ROLLOUT_COLUMNS).sort_by(
            [("prompt_id", "ascending"), ("sample_idx", "ascending")])
        want = pq.read_table(reference / name, columns=ROLLOUT_COLUMNS).sort_by(
            [("prompt_id", "ascending"), ("sample_idx", "ascending")])
        pairs = Counter(zip(got.column("prompt_id").to_pylist(),
                            got.column("sample_idx").to_pylist()))
        assert len(got) == 16 and set(pairs.values()) == {1}, (it, pairs)
        assert got.equals(want), f"iteration {it}: samples differ from the uninterrupted run"
    a, b = final_weights(run), final_weights(reference)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def run_client(thread: threading.Thread):
    """The client the training thread created (the process's default client)."""
    def ready():
        client = _get_global_client()
        if client is None or client.status != "running":
            return None
        names = {str(w["name"]) for w in client.scheduler_info(n_workers=-1)["workers"].values()}
        return client if {"gen-0", "gen-1", "train-0"} <= names else None
    return wait_for(ready, 120, "the run's workers")


def kill_when_processing(client, prefix: str, timeout: float = 120) -> tuple[str, int]:
    """SIGKILL the worker on which a task whose key starts with ``prefix`` is processing;
    returns (its name, its pid)."""
    pids = client.run(os.getpid)
    names = {a: str(w["name"]) for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}

    def find():
        for address, keys in client.processing().items():
            if any(str(k).startswith(prefix) for k in keys):
                return address
        return None

    address = wait_for(find, timeout, f"a task {prefix}* to be processing")
    os.kill(pids[address], signal.SIGKILL)
    return names[address], pids[address]


def finish(thread: threading.Thread, out: dict) -> Path:
    thread.join(timeout=300)
    assert not thread.is_alive(), "the run did not finish"
    if "error" in out:
        raise out["error"]
    return out["run"].path


def test_generation_worker_killed_mid_iteration(base_cfg, reference):
    thread, out = train_in_thread(replace(base_cfg, name="gen-kill"))
    client = run_client(thread)
    killed, pid = kill_when_processing(client, "generate-2-")
    run = finish(thread, out)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert_same_run(run, reference)
    lives = [r for r in json.loads((run / "ledger.json").read_text())["records"]
             if r["kind"] == "worker" and r["name"] == killed]
    assert len(lives) == 2  # the nanny restarted it; billed as two lifetimes
    records = metrics(run)
    assert "recover" not in {m["event"] for m in records}  # no checkpoint needed
    assert all(m["reward_timeouts"] == 0 for m in records if m["event"] == "iteration")


def _processing(dask_scheduler, prefix: str) -> list[str]:
    return [a for a, ws in dask_scheduler.workers.items()
            if any(str(ts.key).startswith(prefix) for ts in ws.processing)]


def stop_when_given(client, prefix: str, thread: threading.Thread, out: dict
                    ) -> tuple[str, int]:
    """SIGSTOP a worker as soon as the scheduler has given it a task ``prefix``*; returns
    (its name, its pid). A run that ended first is reported as such."""
    pids = client.run(os.getpid)
    names = {a: str(w["name"]) for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}

    def find():
        if not thread.is_alive():
            raise AssertionError(f"the run ended before a task {prefix}* was seen: "
                                 f"{out.get('error')!r}")
        return next(iter(client.run_on_scheduler(_processing, prefix=prefix)), None)

    address = wait_for(find, 120, f"a task {prefix}*")
    os.kill(pids[address], signal.SIGSTOP)
    return names[address], pids[address]


@pytest.mark.slow
def test_stopped_generation_worker_costs_its_deadline_and_loses_nothing(base_cfg, reference):
    """A SIGSTOPped worker sends no heartbeat and never dies. Past its deadline (from the
    task it was given; its results, if it finished first, are held up the same) it is
    killed and restarted as if SIGKILLed, and the run is the uninterrupted one (before: it
    waited for as long as the worker stayed stopped, or Dask's worker TTL)."""
    cfg = replace(base_cfg, name="gen-stop", min_stall_s=20.0, stall_timeout_factor=2.0)
    thread, out = train_in_thread(cfg)
    client = run_client(thread)
    stopped, pid = stop_when_given(client, "generate-2-", thread, out)
    stopped_at = time.time()
    try:
        run = finish(thread, out)
    finally:
        if psutil.pid_exists(pid):  # the test's own cleanup, whatever happened
            os.kill(pid, signal.SIGKILL)
    stalls = [m for m in metrics(run) if m["event"] == "stall"]
    # its task's key; none if it had finished the task just before it was stopped
    assert [(s["worker"], s["key"][:11]) for s in stalls] in ([(stopped, "generate-2-")],
                                                               [(stopped, "")]), stalls
    stall = stalls[0]
    assert stall["deadline_s"] == (2.0 * stall["predicted_s"] + 20.0 if stall["key"] else 20.0)
    assert stall["no_progress_s"] > stall["deadline_s"]
    assert stall["time"] - stopped_at < 2 * stall["deadline_s"]  # not "as long as stopped"
    assert_same_run(run, reference)


def test_trainer_killed_mid_update_recovers_from_checkpoint(base_cfg, reference):
    thread, out = train_in_thread(replace(base_cfg, name="trainer-kill"))
    client = run_client(thread)
    wait_for(lambda: (Path(base_cfg.runs_dir) / "trainer-kill/checkpoints/iter-00001/COMMITTED"
                      ).exists(), 120, "checkpoint 1")
    killed, _ = kill_when_processing(client, "update-2")
    run = finish(thread, out)
    assert killed == "train-0"
    records = metrics(run)
    recovers = [m for m in records if m["event"] == "recover"]
    assert len(recovers) == 1 and recovers[0]["iteration"] == 1, recovers
    iterations = [m["iteration"] for m in records if m["event"] == "iteration"]
    assert iterations == [1, 2, 3]  # the abandoned attempt's records are gone
    assert_same_run(run, reference)


@pytest.mark.slow  # a run killed part way: ~30 s
def test_a_trainer_lost_more_than_max_recoveries_ends_the_run(base_cfg):
    """With max_recoveries = 0 the first lost trainer ends the run with an error that names
    the key, instead of going back to the checkpoint."""
    thread, out = train_in_thread(replace(base_cfg, name="no-recoveries", max_recoveries=0))
    client = run_client(thread)
    wait_for(lambda: (Path(base_cfg.runs_dir) / "no-recoveries/checkpoints/iter-00001/"
                      "COMMITTED").exists() or not thread.is_alive(), 300, "checkpoint 1")
    assert kill_when_processing(client, "update-2")[0] == "train-0"
    with pytest.raises(RuntimeError, match="more than max_recoveries = 0"):
        finish(thread, out)
    records = metrics(Path(base_cfg.runs_dir) / "no-recoveries")
    assert "recover" not in {m["event"] for m in records}
    assert [m["iteration"] for m in records if m["event"] == "iteration"] == [1]


def test_max_wall_s_stops_after_the_iteration_past_it(base_cfg):
    """Any positive max_wall_s shorter than one iteration: the run stops after its first
    iteration of three, says so, and checkpoints it though no checkpoint was due
    (checkpoint_every = 100), with the later iterations not run."""
    said = []
    run = train(replace(base_cfg, name="wall", max_wall_s=1e-6, checkpoint_every=100,
                        batch_prompts=2, n_samples=2, max_new_tokens=8, heldout_prompts=2,
                        gen_workers=1), progress=False, log=said.append).path
    records = metrics(run)
    assert [m["iteration"] for m in records if m["event"] == "iteration"] == [1]
    (stop,) = [line for line in said if "max_wall_s" in line]
    assert f"iteration 1 of {ITERATIONS}" in stop
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter-00000", "iter-00001"]
    assert (run / "checkpoints/iter-00001/COMMITTED").exists()
    assert not (run / "rollouts/iter-00002.parquet").exists()


@pytest.mark.slow
def test_driver_killed_then_resume_skips_a_partial_checkpoint(base_cfg, reference, tmp_path):
    name = "driver-kill"
    run = Path(base_cfg.runs_dir) / name
    sets = [f"model='{base_cfg.model}'", f"runs_dir='{base_cfg.runs_dir}'", f"name='{name}'",
            *(f"{k}={getattr(base_cfg, k)}" for k in (
                "iterations", "batch_prompts", "n_samples", "max_new_tokens", "heldout_prompts",
                "eval_every", "gen_workers", "train_threads", "checkpoint_every",
                "keep_checkpoints"))]
    cmd = [sys.executable, "-m", "rlhfless.pipeline.cli", "train", "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    with open(tmp_path / "driver.log", "wb") as log:
        driver = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (run / "checkpoints/iter-00002/COMMITTED").exists()
                 or driver.poll() is not None, 240, "checkpoint 2")
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
        children = psutil.Process(driver.pid).children(recursive=True)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        _, alive = psutil.wait_procs(children, timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
    for proc in alive:  # clean up before failing: no process outlives the test
        proc.kill()
    assert not alive, f"worker processes outlived the driver: {alive}"
    # the newest whole checkpoint is damaged on disk: a chunk cut short
    newest = max((run / "checkpoints").glob("iter-*"))
    chunk = next((newest / "trainer" / "model").rglob("c.*"))
    chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    records = metrics(run)
    resume = [m for m in records if m["event"] == "resume"]
    assert len(resume) == 1 and resume[0]["iteration"] < int(newest.name.split("-")[1])
    assert newest.name in resume[0]["skipped"][0] and "bytes" in resume[0]["skipped"][0]
    assert [m["iteration"] for m in records if m["event"] == "iteration"] == [1, 2, 3]
    assert_same_run(run, reference)
