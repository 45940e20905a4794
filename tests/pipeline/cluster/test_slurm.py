"""A real Slurm: a short elastic training run whose pools are Slurm jobs.

Needs a Slurm controller that answers ``sinfo`` (``.ci/slurm-up`` starts a single-node one,
and ``.ci/run`` sets ``RLHFLESS_REQUIRE_SLURM=1`` so that CI fails rather than skips).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections import Counter

import pyarrow.parquet as pq
import pytest

from rlhfless.pipeline.config import Config
from rlhfless.pipeline.train.loop import train


def _slurm_missing() -> str | None:
    if shutil.which("sinfo") is None:
        return "no Slurm here: 'sinfo' is not on PATH (.ci/slurm-up starts a single-node one)"
    probe = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"Slurm does not answer: sinfo says {probe.stderr.strip()!r}"
    try:
        import dask_jobqueue  # noqa: F401
    except ImportError:
        return "dask-jobqueue (the hpc extra) is not installed"
    return None


@pytest.fixture(scope="module")
def slurm():
    reason = _slurm_missing()
    if reason and os.environ.get("RLHFLESS_REQUIRE_SLURM") == "1":
        pytest.fail(f"RLHFLESS_REQUIRE_SLURM=1 but {reason}")
    if reason:
        pytest.skip(reason)


def _our_jobs(prefix: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i %j %T"], capture_output=True, text=True,
                         check=True).stdout
    return [line for line in out.splitlines() if prefix in line]


def test_generation_pool_of_slurm_jobs_scales_with_the_policy(slurm, tiny_model_dir, tmp_path):
    name = f"slurm{os.getpid()}"
    prefix = f"rlhfless-{name}"  # the job names of this run: <prefix>-gen, <prefix>-train
    seen: list[list[str]] = []  # squeue at every metrics record, while the run is live
    cfg = Config(model=str(tiny_model_dir), runs_dir=str(tmp_path), name=name,
                 iterations=2, batch_prompts=8, n_samples=3, max_new_tokens=16,
                 heldout_prompts=8, eval_every=2, policy="elastic", gen_workers=2,
                 lambda_cost=1.0, tau=0.5, keep_alive_s=0.0, train_threads=1,
                 worker_memory="2GiB", cluster="slurm", walltime="00:15:00",
                 job_start_timeout_s=120.0)
    run = train(cfg, progress=False, log=lambda *_: None,
                on_metrics=lambda record: seen.append(_our_jobs(prefix)))

    # the workers were Slurm jobs: squeue listed them running, and each job logged its worker
    running = Counter(line.split()[1] for snap in seen for line in snap if "RUNNING" in line)
    assert running[f"{prefix}-gen"] >= 1 and running[f"{prefix}-train"] >= 1, seen
    logs = {p.name: p.read_text() for p in (run.path / "jobs").glob("*.err")}
    gen_jobs = {re.search(r"-(\d+)\.err$", n).group(1): text for n, text in logs.items()
                if n.startswith(f"{prefix}-gen-")}
    names = {re.search(r"Worker name:\s+(\S+)", t).group(1) for t in gen_jobs.values()}
    assert len(gen_jobs) >= 2 and all(n.startswith("gen-") for n in names), names
    # the secure default: every job's worker spoke TLS to the scheduler
    assert all(re.search(r"Registered to:\s+tls://", t) for t in logs.values()), logs

    # scaled up and down by the policy, every decision recorded
    decisions = run.read_jsonl("decisions.jsonl")
    scales = [d for d in decisions if d["kind"] == "scale"]
    assert len(scales) == 2 and any(d["to"] > d["from"] for d in scales), decisions
    assert sum(d["kind"] == "release" for d in decisions) >= 1

    # the run itself is whole: every sample once, on-policy
    for it in (1, 2):
        table = pq.read_table(run.path / "rollouts" / f"iter-{it:05d}.parquet")
        pairs = Counter(zip(table.column("prompt_id").to_pylist(),
                            table.column("sample_idx").to_pylist()))
        assert len(pairs) == 24 and set(pairs.values()) == {1}
        assert set(table.column("worker").to_pylist()) <= names
    ledger = run.read_json("ledger.json")
    gen_lives = [r for r in ledger["records"] if r["kind"] == "worker" and r["pool"] == "gen"]
    assert len(gen_lives) == len(gen_jobs) and all(r["t_end"] for r in gen_lives)

    # nothing left in the queue (cancelled jobs pass through COMPLETING first)
    deadline = time.time() + 60
    while (left := _our_jobs(prefix)) and time.time() < deadline:
        time.sleep(0.5)
    assert left == [], left
