"""A run that diverges, end to end: a learning rate so large that the first update with a
nonzero gradient moves every weight by about 1e30 (Adam's first step is lr x the gradient's
sign). The next update's gradient is NaN: squares of 1e30 overflow float32 inside the norms,
and the KL term (kl_coef > 0) differentiates through them even where every advantage is 0.
All through the real model, trainer and update. The run stops with one line naming the
iteration (exit 2, no traceback), the diverged update is not committed, and ``rlhfless
export`` writes the last finite model.

Without the KL term a batch whose every group has equal rewards has zero advantages, a zero
gradient and an update of zero whatever the learning rate (how a small batch of the tiny
model kept lr = 1e6 finite), and the broken model's rewards are all equal."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from rlhfless.pipeline.cli import main


@pytest.mark.slow
def test_a_diverging_run_stops_in_one_line_and_exports_its_last_finite_model(
        tiny_model_dir, tmp_path, capsys):
    cmd = [sys.executable, "-m", "rlhfless.pipeline.cli", "train", "--no-progress"]
    for s in (f"model='{tiny_model_dir}'", "name='diverge'", "iterations=6", "batch_prompts=8",
              "n_samples=4", "max_new_tokens=32", "heldout_prompts=4", "eval_every=100",
              "gen_workers=1", "train_threads=1", "checkpoint_every=1", "keep_checkpoints=1",
              "lr=1e30", "kl_coef=0.1"):
        cmd += ["--set", s]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    run = tmp_path / "runs" / "diverge"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    diverged = [m for m in records if m["event"] == "iteration" and m.get("nonfinite_update")]
    assert len(diverged) == 1, records
    iteration = diverged[0]["iteration"]
    assert lines[0].startswith(f"rlhfless: iteration {iteration}: the loss or gradient is not "
                               "finite"), lines[0]
    assert not (run / f"checkpoints/iter-{iteration:05d}").exists()  # not committed
    assert main(["export", str(run), "-o", str(tmp_path / "hf")]) == 0
    exported = json.loads(capsys.readouterr().out)
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported["checkpoint"].endswith(f"iter-{iteration - 1:05d}")
    assert weights and all(bool(t.float().isfinite().all()) for t in weights.values())
