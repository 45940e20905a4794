"""``rlhfless export`` loses nothing by a mistake: it refuses an output directory inside a run
or not empty, refuses to fall back silently when the newest checkpoint is damaged, says
which checkpoint it took and why it passed over newer ones, says so when the live run pruned
the checkpoint while it was read; and pruning keeps the newest checkpoint with finite
weights. Real checkpoints of the tiny model, the real command line."""

from __future__ import annotations

import json

import pytest
import torch
from test_checkpoint import save
from test_hostile_inputs import one_line_error, snapshot
from transformers import AutoModelForCausalLM

from rlhfless.pipeline.cli import main
from rlhfless.pipeline.config import Config
from rlhfless.pipeline.durable import checkpoint as ckpt
from rlhfless.pipeline.durable.runs import RunDir


@pytest.fixture
def run(tiny_model_dir, tmp_path, monkeypatch):
    """A run directory with whole checkpoints 1 and 2 of the tiny model."""
    monkeypatch.chdir(tmp_path)
    made = RunDir.create(Config(runs_dir="runs", name="r"))
    made.release()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    opt = torch.optim.AdamW(model.parameters())
    for it in (1, 2):
        save(made.path / "checkpoints", it, model, opt, model_path=str(tiny_model_dir))
    return made.path


@pytest.mark.parametrize("out", ["runs/r", "runs/r/checkpoints", "runs/r/new/hf"])
def test_export_into_a_run_is_refused_and_the_run_unchanged(run, tmp_path, capsys, out):
    """``-o runs/r`` replaced the run's config.json with the model's: it no longer resumed."""
    before = snapshot(tmp_path)
    err = one_line_error(capsys, ["export", str(run), "-o", out])
    assert "lies inside the run directory" in err and "outside any run" in err, err
    assert snapshot(tmp_path) == before


def test_export_into_a_directory_that_is_not_empty_is_refused(run, tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    before = snapshot(tmp_path)
    err = one_line_error(capsys, ["export", str(run), "-o", "mine"])
    assert "-o mine is not empty" in err, err
    assert snapshot(tmp_path) == before
    (tmp_path / "empty").mkdir()
    assert main(["export", str(run), "-o", "empty"]) == 0
    assert (tmp_path / "empty" / "config.json").is_file()


@pytest.mark.parametrize("damage", ["no manifest", "truncated"])
def test_a_damaged_newest_checkpoint_is_refused_unless_one_is_named(run, capsys, damage):
    """It exported the older one, silently, with exit 0."""
    newest = run / "checkpoints" / "iter-00002"
    if damage == "no manifest":
        (newest / ckpt.MARKER).unlink()
    else:
        chunk = next((newest / "trainer" / "model").rglob("c.*"))
        chunk.write_bytes(chunk.read_bytes()[:-3])
    err = one_line_error(capsys, ["export", str(run), "-o", "hf"])
    assert "iter-00002 is damaged" in err and "--iteration 1" in err, err
    assert not (run.parent.parent / "hf").exists()
    assert main(["export", str(run), "--iteration", "1", "-o", "hf"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["checkpoint"].endswith("iter-00001")
    assert err.splitlines()[-1] == "rlhfless: exported iter-00001 (as asked)"  # after bars


def test_export_says_what_it_took_and_passes_over_non_finite_weights(run, tiny_model_dir,
                                                                     capsys):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    save(run / "checkpoints", 3, model, torch.optim.AdamW(model.parameters()), finite=False,
         model_path=str(tiny_model_dir))
    capsys.readouterr()
    assert main(["export", str(run), "-o", "hf"]) == 0
    out, err = capsys.readouterr()
    said = json.loads(out)
    assert said["checkpoint"].endswith("iter-00002")
    assert said["passed_over"] == ["iter-00003: its weights are not finite (NaN or inf)"]
    assert err.splitlines()[-1] == (  # after the progress bars of the loading
        "rlhfless: exported iter-00002 (the newest whole one with finite weights; passed "
        "over iter-00003: its weights are not finite (NaN or inf))")
    exported = AutoModelForCausalLM.from_pretrained(run.parent.parent / "hf")
    assert all(torch.isfinite(p).all() for p in exported.parameters())


def test_pruning_keeps_the_newest_finite_checkpoint(run, tiny_model_dir):
    """keep_checkpoints = 2 pruned every finite checkpoint of a diverged run."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    opt = torch.optim.AdamW(model.parameters())
    for it in (3, 4, 5):
        save(run / "checkpoints", it, model, opt, finite=False, model_path=str(tiny_model_dir))
    ckpt.prune(run / "checkpoints", keep=2)
    assert [p.name for p in ckpt.checkpoints(run / "checkpoints")] == [
        "iter-00002", "iter-00004", "iter-00005"]
    save(run / "checkpoints", 6, model, opt, model_path=str(tiny_model_dir))
    ckpt.prune(run / "checkpoints", keep=2)  # a finite one among the newest: no extra
    assert [p.name for p in ckpt.checkpoints(run / "checkpoints")] == [
        "iter-00005", "iter-00006"]


def test_a_checkpoint_pruned_while_it_is_read_is_said_so(run, tiny_model_dir, capsys,
                                                         monkeypatch):
    """The live run commits iteration 3 and prunes iteration 2 while export reads it: that
    was "unexpected KeyError" (or "No such file ... .parquet") with nothing said of why."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    load = AutoModelForCausalLM.from_pretrained

    def live_run_meanwhile(*args, **kwargs):
        save(run / "checkpoints", 3, model, torch.optim.AdamW(model.parameters()),
             model_path=str(tiny_model_dir))
        ckpt.prune(run / "checkpoints", keep=1)
        return load(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", live_run_meanwhile)
    assert main(["export", str(run), "-o", "hf"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # after the progress bars of the loading
    assert "Traceback" not in err
    assert "iter-00002 was pruned by the live run while it was read" in err, err
    assert "--iteration" in err
