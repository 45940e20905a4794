"""Shared fixtures: a small tiny-model build (few warm-start steps) cached per session, and
one finished elastic run that the report, tracker and notebook tests read. Under
``RLHFLESS_NO_SKIPS=1`` (``.ci/run`` sets it) a skipped test fails: CI runs every test."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from rlhfless.ops.toy.tinymodel import TinyRecipe, ensure_tiny_model
from rlhfless.ops.toy.tinytask import TallyTask

sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))  # bench harnesses
# Test modules share helpers across the folders that mirror the packages (test_ranks uses
# test_security's): every folder under tests/ is importable by its modules' names, which
# pytest already requires to be unique, so a file run alone finds its siblings' helpers.
sys.path.extend(sorted({str(f.parent) for f in Path(__file__).resolve().parent.rglob("test_*.py")}))

# Small enough to build in seconds; the full recipe is exercised by the slow tests.
QUICK_RECIPE = TinyRecipe(
    task=TallyTask(max_items=8, n_train=64, n_heldout=16, n_sft=256),
    sft_steps=10,
    sft_batch=16,
    max_positions=128,
)


def _fail_skip(report) -> None:
    """A skip is a failure where every test must run (``RLHFLESS_NO_SKIPS=1``)."""
    if (report.skipped and not hasattr(report, "wasxfail")
            and os.environ.get("RLHFLESS_NO_SKIPS") == "1"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome, report.longrepr = "failed", f"skipped where every test must run: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    _fail_skip((yield).get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    _fail_skip((yield).get_result())


@pytest.fixture(scope="session")
def quick_recipe():
    return QUICK_RECIPE


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("cache"), QUICK_RECIPE, log=lambda *_: None)


@pytest.fixture(scope="session")
def eos_model_dir(tiny_model_dir, tmp_path_factory):
    """The embedded architecture, redrawn and EOS-prone (``tests/model_support.py``), saved
    as a model directory, so that greedy decoding ends at different lengths per prompt and a
    pause leaves a tail."""
    from model_support import eos_prone, redraw
    from transformers import AutoTokenizer

    from rlhfless.ops.toy.tinymodel import build_model

    out = tmp_path_factory.mktemp("eos-model")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    recipe = TinyRecipe()
    model = eos_prone(redraw(build_model(recipe, tok), recipe.seed), tok)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "train.jsonl").write_text((tiny_model_dir / "train.jsonl").read_text())
    return out


@pytest.fixture(scope="session")
def finished_run(tiny_model_dir, tmp_path_factory):
    """A real two-iteration run of the elastic policy on a LocalCluster: metrics, rollouts,
    decisions, ledger, dashboard record, and every tracker's local store (W&B offline, MLflow
    and trackio in the run directory, TensorBoard)."""
    from rlhfless.pipeline.config import Config
    from rlhfless.pipeline.train.loop import train

    cfg = Config(model=str(tiny_model_dir), runs_dir=str(tmp_path_factory.mktemp("runs")),
                 name="finished", iterations=2, batch_prompts=8, n_samples=3,
                 max_new_tokens=16, heldout_prompts=8, eval_every=1, policy="elastic",
                 gen_workers=2, lambda_cost=1.0, keep_alive_s=0.0, train_threads=1,
                 dashboard=True,  # the report links it while the run is live
                 report_to=["tensorboard", "wandb", "mlflow", "trackio"])
    with pytest.MonkeyPatch.context() as env:  # nothing leaves the machine
        env.setenv("WANDB_MODE", "offline")
        for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "TRACKIO_DIR",
                     "WANDB_PROJECT"):
            env.delenv(name, raising=False)
        return train(cfg, progress=False, log=print).path
