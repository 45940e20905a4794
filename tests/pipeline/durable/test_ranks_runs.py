"""Whole runs with trainer ranks on a LocalCluster (gloo): ``train_workers = 2`` trains as
one rank does, a checkpoint of 2 ranks resumes on 1 and one of 1 rank on 2 with bitwise
the same weights, and a rank killed with SIGKILL sends the run back to its last checkpoint.
While two ranks train, none of the run's processes listens beyond loopback, and the run's
files (the ranks' checkpoints too) are its user's only.
The groups are made informative by the parity reward, so every update moves the weights."""

from __future__ import annotations

import contextlib
import json
import shutil
from dataclasses import replace
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
import torch
import zarr
from run_support import train_in_thread, wait_for
from safetensors.torch import load_file
from test_faults import (
    ROLLOUT_COLUMNS,
    finish,
    kill_when_processing,
    metrics,
)
from test_security import LOOPBACK, listening
from test_security_private import assert_private

from rlhfless.pipeline.config import Config
from rlhfless.pipeline.durable.recovery import resume_config
from rlhfless.pipeline.durable.zarr_state import get_tensors
from rlhfless.pipeline.train.loop import train

ITERATIONS = 3
PARITY = {"tally": "parity_reward:parity"}  # informative groups from an untrained model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base_cfg(tiny_model_dir, tmp_path_factory) -> Config:
    return Config(model=str(tiny_model_dir), runs_dir=str(tmp_path_factory.mktemp("runs")),
                  iterations=ITERATIONS, batch_prompts=4, n_samples=4, max_new_tokens=16,
                  heldout_prompts=4, eval_every=100, gen_workers=1, train_threads=1,
                  checkpoint_every=1, keep_checkpoints=2, rewards=PARITY)


def quiet_train(cfg: Config, **kw) -> Path:
    return train(cfg, progress=False, log=lambda *_: None, **kw).path


@pytest.fixture(scope="module")
def one_rank(base_cfg) -> Path:
    return quiet_train(replace(base_cfg, name="one-rank"))


LISTENED: set[str] = set()  # addresses the two-rank run's processes listened on


def run_listening() -> set[str]:
    """Addresses this process and every process below it listen on now."""
    addresses = set()
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            addresses |= listening(process.pid)
    return addresses


@pytest.fixture(scope="module")
def two_ranks(base_cfg) -> Path:
    def watch(record: dict) -> None:
        if record["event"] == "iteration":  # the group is formed, its ranks have trained
            LISTENED.update(run_listening())
    return quiet_train(replace(base_cfg, name="two-ranks", train_workers=2), on_metrics=watch)


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "weights" / f"v{ITERATIONS}.safetensors")


def test_two_ranks_train_as_one(one_rank, two_ranks, base_cfg):
    a, b = final_weights(one_rank), final_weights(two_ranks)
    assert a.keys() == b.keys()
    moved = max((a[k] - load_file(one_rank / "weights" / f"v{ITERATIONS - 1}.safetensors")[k]
                 ).abs().max().item() for k in a)
    assert moved > 10 * base_cfg.lr / 100  # the updates did something
    for name in a:  # float32 sums in another order; Adam amplifies gradients near 0
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0.05 * base_cfg.lr)
    for run in (one_rank, two_ranks):
        losses = [m["loss"] for m in metrics(run) if m["event"] == "iteration"]
        assert len(losses) == ITERATIONS and any(loss != 0 for loss in losses)


def test_two_ranks_listen_on_loopback_only_and_write_privately(two_ranks):
    assert LISTENED and LISTENED <= LOOPBACK, LISTENED
    assert any((two_ranks / "checkpoints").iterdir())
    assert_private(two_ranks)


@pytest.mark.parametrize(("source", "ranks"), [("two_ranks", 1), ("one_rank", 2)])
def test_checkpoint_resumes_on_another_number_of_ranks_bitwise(source, ranks, request,
                                                              tmp_path):
    """The source run's checkpoint of iteration 2 (the last one removed) resumes on
    ``ranks`` ranks and trains iteration 3: its samples are the uninterrupted run's bit for
    bit (weights, data position and draws came back whole), its weights after the update
    are the uninterrupted run's up to the order of the ranks' float32 sums, and the
    trainer publishes what it checkpoints."""
    origin = request.getfixturevalue(source)
    run = tmp_path / f"{source}-on-{ranks}"
    shutil.copytree(origin, run)
    shutil.rmtree(run / "weights")  # what the resumed trainer publishes is all there is
    shutil.rmtree(run / f"checkpoints/iter-{ITERATIONS:05d}")
    last = f"rollouts/iter-{ITERATIONS:05d}.parquet"
    (run / last).unlink()
    quiet_train(resume_config(run, [f"train_workers={ranks}"]), resume=True)
    records = metrics(run)
    resumed = max(i for i, m in enumerate(records) if m["event"] == "resume")
    assert records[resumed]["iteration"] == ITERATIONS - 1
    assert [m["iteration"] for m in records[resumed:] if m["event"] == "iteration"] == [
        ITERATIONS]
    got, want = (pq.read_table(r / last, columns=ROLLOUT_COLUMNS).sort_by(
        [("prompt_id", "ascending"), ("sample_idx", "ascending")]) for r in (run, origin))
    assert len(got) == 16 and got.equals(want)
    stored = get_tensors(zarr.open_group(run / f"checkpoints/iter-{ITERATIONS:05d}",
                                         mode="r")["trainer/model"])
    published, uninterrupted = final_weights(run), final_weights(origin)
    assert published.keys() <= stored.keys() and published
    lr = resume_config(run, []).lr
    for name, tensor in published.items():
        assert torch.equal(tensor, stored[name]), name
        # as test_two_ranks_train_as_one: float32 sums in another order
        torch.testing.assert_close(tensor, uninterrupted[name], rtol=0, atol=0.05 * lr)


def test_rank_killed_mid_update_recovers_from_checkpoint(base_cfg, two_ranks):
    cfg = replace(base_cfg, name="rank-kill", train_workers=2)
    thread, out = train_in_thread(cfg)
    wait_for(lambda: (Path(cfg.runs_dir) / "rank-kill/checkpoints/iter-00001/COMMITTED"
                      ).exists(), 180, "checkpoint 1")
    from distributed.client import _get_global_client

    client = wait_for(_get_global_client, 30, "the run's client")
    killed, _ = kill_when_processing(client, "_update_rank-rank-")
    run = finish(thread, out)
    assert killed.startswith("train-")
    records = metrics(run)
    recovers = [m for m in records if m["event"] == "recover"]
    assert len(recovers) == 1 and recovers[0]["iteration"] >= 1, recovers
    assert [m["iteration"] for m in records if m["event"] == "iteration"] == [1, 2, 3]
    a, b = final_weights(run), final_weights(two_ranks)
    for name in a:  # the redone iterations are the uninterrupted run's, bit for bit
        assert torch.equal(a[name], b[name]), name
    assert json.loads((run / "config.json").read_text())["train_workers"] == 2
