"""Watching a run: listeners see each metrics record, the dashboard record marks the end
(the trackers' tests are test_trackers.py)."""

from __future__ import annotations

from rlhfless.pipeline.config import Config
from rlhfless.pipeline.durable.runs import RunDir
from rlhfless.pipeline.report.observe import dashboard_status, observed


def test_listeners_get_records_while_observed_and_the_end_is_recorded(tmp_path):
    run = RunDir.create(Config(runs_dir=str(tmp_path), name="watched"))
    seen: list[dict] = []
    with observed(run, "http://127.0.0.1:1/status", seen.append):
        assert dashboard_status(run)["live"] is True
        run.append_metrics({"event": "iteration", "iteration": 1, "reward_mean": 0.5})
    run.append_metrics({"event": "eval", "iteration": 1, "heldout_accuracy": 0.2})
    assert seen == [{"event": "iteration", "iteration": 1, "reward_mean": 0.5}]
    status = dashboard_status(run)
    assert status["link"] == "http://127.0.0.1:1/status" and status["live"] is False
    assert status["ended"] >= status["started"]


def test_a_run_whose_process_died_is_not_live(tmp_path):
    run = RunDir.create(Config(runs_dir=str(tmp_path), name="dead"))
    with observed(run, "http://x/status"):
        info = run.read_json("dashboard.json")
    run.write_json("dashboard.json", {k: v for k, v in info.items() if k != "ended"}
                   | {"pid": 2**22 + 12345})  # beyond the usual pid range: no such process
    assert dashboard_status(run)["live"] is False

