"""Deployments: the batch scripts of each pool's jobs, and config → deployment. No batch
system is needed: the scripts are generated, not submitted."""

from __future__ import annotations

import pytest

from rlhfless.pipeline.cluster.deploy import (
    JobQueueDeployment,
    JobSettings,
    LocalDeployment,
    deployment_from_config,
)
from rlhfless.pipeline.cluster.pools import Pool, pools_from_config
from rlhfless.pipeline.config import Config, ConfigError, load_config, walltime_seconds

pytest.importorskip("dask_jobqueue", reason="dask-jobqueue (the hpc extra) is not installed")

GEN = Pool("gen", 2, 4, {"GEN": 1}, "16GiB", gpus=1, directives=("--constraint=a100",))
TRAIN = Pool("train", 1, 8, {"TRAIN": 1}, "64GiB")


def _slurm(**kw) -> JobQueueDeployment:
    settings = JobSettings("slurm", queue="gpu", account="proj42", walltime="02:00:00",
                           prologue=("module load cuda",), log_directory="/runs/x/jobs", **kw)
    return JobQueueDeployment(settings, job_name_prefix="rlhfless-x")


def _lines(script: str) -> list[str]:
    return [line.strip() for line in script.splitlines() if line.strip()]


def test_slurm_generation_job_asks_for_its_gpus_partition_and_walltime():
    script = _slurm().job_script(GEN, name="gen-3", scheduler="tcp://10.0.0.1:8786")
    lines = _lines(script)
    header = [line for line in lines if line.startswith("#SBATCH")]
    for directive in ("#SBATCH -J rlhfless-x-gen", "#SBATCH -p gpu", "#SBATCH -A proj42",
                      "#SBATCH -n 1", "#SBATCH --cpus-per-task=4", "#SBATCH --mem=16G",
                      "#SBATCH -t 02:00:00", "#SBATCH --gres=gpu:1",
                      "#SBATCH --constraint=a100",
                      "#SBATCH -e /runs/x/jobs/rlhfless-x-gen-%J.err"):
        assert directive in header, (directive, header)
    command = lines[-1]
    assert command.split()[2:4] == ["distributed.cli.dask_worker", "tcp://10.0.0.1:8786"]
    assert "--name gen-3" in command and "--nthreads 4" in command
    assert "--resources GEN=1" in command
    assert "--lifetime 6480s --lifetime-stagger 360s" in command  # 90% / 5% of 2 h
    assert "export OMP_NUM_THREADS=4" in lines and "module load cuda" in lines
    assert "export MALLOC_MMAP_THRESHOLD_=33554432" in lines  # see deploy.MALLOC_ENV
    assert lines.index("module load cuda") < len(lines) - 1  # the prologue runs first


def test_pools_get_their_own_directives_and_no_gpu_unless_asked():
    trainer = _lines(_slurm().job_script(TRAIN))
    assert "#SBATCH --cpus-per-task=8" in trainer and "#SBATCH --mem=64G" in trainer
    assert not any("gres" in line or "a100" in line for line in trainer)
    assert "--resources TRAIN=1" in trainer[-1]


def test_explicit_lifetime_wins_over_the_walltime_default():
    command = _lines(_slurm(lifetime="50m").job_script(GEN))[-1]
    assert "--lifetime 50m --lifetime-stagger 150s" in command


def test_pbs_goes_through_the_same_code_with_a_select_statement():
    settings = JobSettings("pbs", queue="workq", walltime="00:30:00")
    script = _lines(JobQueueDeployment(settings).job_script(GEN))
    assert "#PBS -q workq" in script and "#PBS -l walltime=00:30:00" in script
    assert "#PBS -l select=1:ncpus=4:mem=16GB:ngpus=1" in script
    assert "#PBS -N rlhfless-gen" in script and "#PBS --constraint=a100" in script
    assert "--resources GEN=1" in script[-1]


def test_config_selects_the_deployment_and_builds_pools(tmp_path):
    cfg = load_config(None, ['cluster="slurm"', 'queue="debug"', "gen_gpus=2",
                             'gen_job_directives=["--exclusive"]', 'walltime="00:20:00"'])
    deployment = deployment_from_config(cfg, tmp_path / "run")
    assert isinstance(deployment, JobQueueDeployment)
    assert deployment.settings.log_directory == str((tmp_path / "run" / "jobs").resolve())
    gen, train = pools_from_config(cfg)
    assert gen.gpus == 2 and gen.directives == ("--exclusive",) and train.gpus == 0
    header = _lines(deployment.job_script(gen))
    assert "#SBATCH --gres=gpu:2" in header and "#SBATCH --exclusive" in header
    assert "#SBATCH -p debug" in header and "#SBATCH -t 00:20:00" in header
    assert f"--preload {gen.preload[0]}" in header[-1]  # its task module, before it registers
    assert "export DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL=300s" in header  # the run's bounds
    assert "export DASK_DISTRIBUTED__COMM__TIMEOUTS__TCP=30s" in header
    assert isinstance(deployment_from_config(Config(), tmp_path), LocalDeployment)


def test_local_worker_spec_carries_threads_resources_and_memory():
    spec = LocalDeployment().worker_spec(GEN, "gen-0")
    assert spec["options"]["nthreads"] == 4
    assert spec["options"]["resources"] == {"GEN": 1}
    assert spec["options"]["env"]["OMP_NUM_THREADS"] == "4"


@pytest.mark.parametrize("text, seconds", [("01:00:00", 3600), ("30", 1800), ("10:30", 630),
                                           ("1-02", 93600), ("1-02:03:04", 93784)])
def test_walltime_formats(text, seconds):
    assert walltime_seconds(text) == seconds


@pytest.mark.parametrize("override, message", [
    ('walltime="soon"', "walltime = 'soon': use HH:MM:SS"),
    ('worker_lifetime="forever"', "worker_lifetime = 'forever': use a duration"),
    ('worker_lifetime="2h"', "worker_lifetime = '2h' must be shorter than walltime"),
    ('cluster="k8s"', "cluster = 'k8s' is not allowed"),
    ("gen_job_directives=3", "gen_job_directives = 3 must be a list of strings"),
    ("gen_gpus=-1", "gen_gpus and train_gpus must be >= 0"),
])
def test_bad_hpc_keys_are_one_clear_line(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(None, [override])


def test_train_workers_make_one_batch_job_per_rank_with_its_gpu():
    pools = {p.name: p for p in pools_from_config(Config(train_workers=3, train_gpus=1))}
    assert pools["train"].size == 3  # ranks of one process group (pipeline/tasks/ranks.py)
    lines = _lines(_slurm().job_script(pools["train"], name="train-2"))
    assert "#SBATCH --gres=gpu:1" in lines and "--resources TRAIN=1" in lines[-1]


def test_an_unguarded_driver_script_fails_in_one_line_instead_of_hanging(tmp_path):
    """Local workers start by spawn, which re-runs a script's top level in each of them: a
    script without a ``__main__`` guard starts a second cluster there and its workers never
    connect. Past the start timeout that is an error naming the cause, not a hang."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(
        "from rlhfless.pipeline.cluster.pools import Pool, PoolCluster\n"
        "from rlhfless.pipeline.cluster.deploy import LocalDeployment\n"
        "from rlhfless.schedulers.ledger import CostLedger\n"
        "pools = [Pool('gen', 1, 1, {'GEN': 1}, '1GiB')]\n"
        "PoolCluster(pools, CostLedger({'gen': 1.0}),\n"
        "            deployment=LocalDeployment(start_timeout_s=8.0)).close()\n")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    assert "did not connect within 8 s" in done.stderr
    assert "__main__" in done.stderr


@pytest.mark.parametrize(("keys", "host"), [({"scheduler_host": "127.0.0.2"}, "127.0.0.2"),
                                            ({"interface": "lo"}, "127.0.0.1")])
def test_scheduler_host_and_interface_choose_where_the_scheduler_listens(tmp_path, keys, host):
    """A real PBS cluster object (its scheduler starts here; no job is submitted, there is
    no PBS server to take one): the scheduler listens on ``scheduler_host``, or on the
    address of ``interface``, which the workers' job script is told too."""
    cfg = Config(cluster="pbs", runs_dir=str(tmp_path), **keys)
    deployment = deployment_from_config(cfg, tmp_path / "run")
    cluster = deployment.make_cluster([])
    try:
        assert cluster.scheduler_address.split("://")[1].rsplit(":", 1)[0] == host
    finally:
        cluster.close()
    script = deployment.job_script(GEN)
    assert ("--interface lo" in script) == ("interface" in keys)


def test_the_local_dashboard_serves_no_route_that_changes_the_cluster(tmp_path):
    """The local cluster's dashboard (distributed's default routes): it answers, but the
    HTTP API that retires workers or sets an adaptive target is not served."""
    import urllib.error
    import urllib.request

    cluster = LocalDeployment().make_cluster([])
    try:
        base = cluster.dashboard_link.rsplit("/", 1)[0]
        with urllib.request.urlopen(f"{base}/health", timeout=30) as answer:
            assert answer.status == 200
        for route in ("api/v1/retire_workers", "api/v1/adaptive_target", "api/v1/get_workers"):
            request = urllib.request.Request(f"{base}/{route}", data=b"{}", method="POST")
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(request, timeout=30)
            assert err.value.code in (404, 405), route
    finally:
        cluster.close()
