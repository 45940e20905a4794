"""The run directory's JSON files: strict JSON always, and a last line cut short by a killed
writer tolerated by readers and dropped before the run appends again."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from rlhfless.pipeline.cli import main
from rlhfless.pipeline.durable.recovery import trim_run
from rlhfless.pipeline.durable.runs import RunDir


def strict(line: str) -> dict:
    """``json.loads`` that refuses NaN and Infinity, as other JSON readers do."""
    def refuse(name: str):
        raise ValueError(f"{name} is not JSON")
    return json.loads(line, parse_constant=refuse)


def test_nan_and_infinity_are_written_as_null_and_named(tmp_path):
    run = RunDir(tmp_path)
    seen = []
    run.listeners.append(seen.append)
    run.append_metrics({"event": "iteration", "iteration": 1, "loss": float("nan"),
                        "grad_norm": np.float32("inf"), "reward_mean": 0.5,
                        "stages": {"update_s": -np.inf, "ok": [1.0, float("nan")]}})
    run.write_json("ledger.json", {"totals": {"cost": float("inf")}})
    record = strict((tmp_path / "metrics.jsonl").read_text())
    assert record["loss"] is None and record["grad_norm"] is None
    assert record["stages"] == {"update_s": None, "ok": [1.0, None]}
    assert record["reward_mean"] == 0.5
    assert record["nonfinite"] == ["grad_norm", "loss", "stages.ok", "stages.update_s"]
    assert strict((tmp_path / "ledger.json").read_text()) == {
        "totals": {"cost": None}, "nonfinite": ["totals.cost"]}
    assert np.isnan(seen[0]["loss"])  # listeners get the record as it was given


def test_a_last_line_cut_short_is_passed_over_then_dropped(tmp_path):
    run = RunDir(tmp_path)
    for i in (1, 2):
        run.append_metrics({"event": "iteration", "iteration": i})
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"event": "iteration", "itera')  # the writer was killed here
    assert [m["iteration"] for m in run.metrics()] == [1, 2]
    trim_run(run, 2, drop_eval_at=False)  # what --resume does before appending
    run.append_metrics({"event": "iteration", "iteration": 3})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [strict(line)["iteration"] for line in lines] == [1, 2, 3]


def test_a_whole_last_record_without_its_newline_gets_one(tmp_path):
    run = RunDir(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 1}\n{"iteration": 2}')
    trim_run(run, 5, drop_eval_at=False)
    run.append_metrics({"iteration": 3})
    assert [m["iteration"] for m in run.metrics()] == [1, 2, 3]


def test_a_bad_line_before_the_last_is_an_error_naming_it(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 1}\n{"iter\n{"iteration": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON record"):
        RunDir(tmp_path).metrics()


def test_report_reads_a_run_whose_writer_was_killed_mid_line(finished_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"event": "iteration", "iteration": 3, "reward_me')
    with (run / "decisions.jsonl").open("a") as f:
        f.write('{"kind": "sca')
    assert main(["report", str(run), "-o", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "index.html").is_file()
    (run / "metrics.jsonl").write_text('{"x": 1}\nnot json\n{"x": 2}\n')
    capsys.readouterr()
    assert main(["report", str(run), "-o", str(tmp_path / "report")]) == 2
    err = capsys.readouterr().err.strip()
    assert "metrics.jsonl:2" in err and "\n" not in err
