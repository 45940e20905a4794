"""Versions published through the cluster (``weight_store = "cluster"``) on a real
LocalCluster: a worker fetches what another worker's process holds, over Dask's comms (TLS
here), into
its own directory; the holder keeps its ``keep`` newest versions, and a holder that left the
cluster is not asked. A run with
``weight_store = "cluster"`` writes no version into the run directory, yet its generation
workers generate each iteration from the trainer's version (and report what fetching it
took), and it resumes from its checkpoint the same way."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from distributed import Client, LocalCluster
from distributed.security import Security
from safetensors.torch import load_file

from rlhfless.pipeline.config import Config, ConfigError
from rlhfless.pipeline.tasks.weight_store import held_versions, local_weights, publish_version
from rlhfless.pipeline.train.loop import train

STATE = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)}


def _shifted(version: int) -> dict[str, torch.Tensor]:
    return {k: v + version for k, v in STATE.items()}


def test_a_worker_fetches_the_version_another_process_holds(tmp_path):
    security = Security.temporary()  # the fetch goes over the cluster's TLS
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, protocol="tls://",
                      security=security, dashboard_address=None,
                      local_directory=tmp_path) as cluster, \
            Client(cluster, security=security) as client:
        trainer, generator = sorted(client.scheduler_info()["workers"])
        assert trainer.startswith("tls://")

        def on(address, fn, *args):
            return client.submit(fn, *args, workers=[address], pure=False).result()

        refs = [on(trainer, publish_version, _shifted(v), None, v, 2) for v in (1, 2, 3)]
        assert {r.holder for r in refs} == {trainer}
        assert on(trainer, held_versions) == [2, 3]
        assert on(generator, held_versions) == []  # another process: nothing shared in memory
        local = on(generator, local_weights, refs[2])
        assert local.version == 3 and Path(local.path).name == "v3.safetensors"
        assert refs[2].nbytes == Path(local.path).stat().st_size  # the bytes it holds
        got = on(generator, load_file, local.path)
        assert got.keys() == STATE.keys()
        assert all(torch.equal(got[k], _shifted(3)[k]) for k in STATE)
        with pytest.raises(RuntimeError, match=r"v1 is not held .* \[2, 3\]"):
            on(generator, local_weights, refs[0])
        on(trainer, publish_version, _shifted(2), None, 2, 2)  # a resume publishes v2 again
        assert on(trainer, held_versions) == [2]  # and v3, newer, is gone
        client.retire_workers([trainer], close_workers=True)  # a trainer lost
        with pytest.raises(RuntimeError, match="held by the trainer at .* has left the cluster"):
            on(generator, local_weights, refs[2])  # at once, not at a connection's timeout


def test_an_unknown_weight_store_is_a_one_line_error():
    with pytest.raises(ConfigError, match=r"weight_store = 's3' is not allowed; choose one "
                                          r"of \('run', 'cluster'\)"):
        Config(weight_store="s3")


def _policy_versions(run, iteration: int) -> set[int]:
    table = pq.read_table(run.path / "rollouts" / f"iter-{iteration:05d}.parquet")
    return set(table.column("policy_version").to_pylist())


def test_a_run_trains_and_resumes_with_no_version_on_disk(tiny_model_dir, tmp_path):
    def cfg(iterations: int) -> Config:
        return Config(model=str(tiny_model_dir), runs_dir=str(tmp_path), name="nodisk",
                      iterations=iterations, batch_prompts=2, n_samples=2, max_new_tokens=8,
                      heldout_prompts=2, eval_every=100, gen_workers=1, train_threads=1,
                      checkpoint_every=1, weight_store="cluster")

    def published(run) -> list[str]:
        return sorted(p.name for p in run.weights.glob("*")) if run.weights.exists() else []

    run = train(cfg(2), progress=False, log=lambda *_: None)
    assert published(run) == []
    first = [m for m in run.metrics() if m.get("event") == "iteration"]
    # iteration 1 generated from the model itself; iteration 2's workers fetched v1 first
    # over the cluster and reported the seconds
    assert first[0]["weight_fetch_s"] == 0 < first[1]["weight_fetch_s"]
    resumed = train(cfg(3), progress=False, log=lambda *_: None, resume=True)
    iterations = [m for m in resumed.metrics() if m.get("event") == "iteration"]
    assert [m["iteration"] for m in iterations] == [1, 2, 3]
    # each iteration generated from the version the trainer had published before it: v2
    # came over the cluster from the trainer that restored checkpoint 2
    assert [_policy_versions(resumed, i) for i in (1, 2, 3)] == [{0}, {1}, {2}]
    assert published(resumed) == []
