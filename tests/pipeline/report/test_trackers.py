"""report_to: one real run (``finished_run``, all four trackers, nothing remote) read back from
each tracker's own local store with its own reader; the values per iteration are those of
metrics.jsonl. A tracker named but not installed is one line at config time; a tracker that
fails mid-run is said, dropped, and the run's files go on."""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import pytest

from rlhfless.pipeline.cli import main
from rlhfless.pipeline.config import Config
from rlhfless.pipeline.durable.runs import RunDir
from rlhfless.pipeline.report.trackers import Trackers, scalars

REPORT = {"index.html", "graph.png"}  # of the artifacts: the HTML report, the iteration graph


def expected(run: Path) -> list[tuple[str, int, float]]:
    """(key, step, value) of every number in metrics.jsonl, keyed as the trackers get them."""
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        step, metrics = scalars(json.loads(line))
        out += [(key, step, value) for key, value in metrics.items()]
    keys = {key for key, _, _ in out}
    assert {"iteration/reward_mean", "iteration/loss", "eval/heldout_accuracy"} <= keys
    assert sorted(s for k, s, _ in out if k == "eval/heldout_accuracy") == [0, 1, 2]
    return sorted(out)


def test_tensorboard_has_every_metric_by_iteration(finished_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(finished_run / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    got = sorted((tag, e.step, e.value) for tag in events.Tags()["scalars"]
                 for e in events.Scalars(tag))
    want = expected(finished_run)
    assert [(k, s) for k, s, _ in got] == [(k, s) for k, s, _ in want]
    assert [v for *_, v in got] == pytest.approx([v for *_, v in want], rel=1e-6)  # float32
    assert "config/text_summary" in events.Tags()["tensors"]


def test_mlflow_has_the_config_every_metric_and_the_report(finished_run):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{finished_run / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("rlhfless").experiment_id])
    assert run.info.run_name == "finished" and run.info.status == "FINISHED"
    assert run.data.params["report_to"] == str(["tensorboard", "wandb", "mlflow", "trackio"])
    got = sorted((key, m.step, m.value) for key in run.data.metrics
                 for m in client.get_metric_history(run.info.run_id, key))
    assert got == expected(finished_run)
    names = {Path(f.path).name for f in client.list_artifacts(run.info.run_id, "report")}
    assert REPORT <= names
    assert (finished_run / "mlflow-artifacts").is_dir()  # in the run directory


def wandb_records(folder: Path) -> list:
    """The records of the ``.wandb`` file of the one offline run under ``folder``, as W&B's
    protobuf ``Record``s, once its exit record is there (W&B's core process may write the
    file after ``finish`` returned). The file: a 7-byte header, then 32 KiB blocks of chunks
    (crc32c, length, type: 1 whole, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    [path] = folder.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 60
    while True:
        data, pos, pending, records = path.read_bytes(), 7, b"", []
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if kind == 0 or pos + 7 + length > len(data):
                break
            pending += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):
                records.append(pb.Record.FromString(pending))
                pending = b""
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{path}: no exit record after 60 s"
        time.sleep(0.2)


def history(records: list) -> list[dict]:
    """The rows logged, in order, keyed as logged."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json)
             for item in record.history.item}
            for record in records if record.WhichOneof("record_type") == "history"]


def test_wandb_offline_run_has_the_config_every_metric_and_the_report(finished_run):
    records = wandb_records(finished_run)
    got = sorted((k, row["iteration"], v) for row in history(records) for k, v in row.items()
                 if k != "iteration" and not k.startswith("_"))
    assert got == expected(finished_run)
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["name"] == "finished" and config["iterations"] == 2
    [exit_record] = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 0
    [offline] = (finished_run / "wandb").glob("offline-run-*")
    assert REPORT <= {p.name for p in (offline / "files" / "report").iterdir()}


def test_trackio_has_the_config_every_metric_and_the_report(finished_run):
    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    assert Path(trackio.utils.TRACKIO_DIR) == finished_run / "trackio"  # its store: the run's
    got = sorted((k, row["step"], v) for row in SQLiteStorage.get_logs("rlhfless", "finished")
                 for k, v in row.items() if k not in ("step", "timestamp"))
    assert got == expected(finished_run)
    [run] = trackio.Api().runs("rlhfless")
    assert run.config["name"] == "finished" and run.config["iterations"] == 2
    report = SQLiteStorage.get_artifact_manifest("rlhfless", "report", "latest")
    assert report["type"] == "report" and REPORT <= {e["path"] for e in report["manifest"]}


def test_a_tracker_named_but_not_installed_is_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what importlib finds when it is absent
    argv = ["train", "--set", f"runs_dir='{tmp_path}'", "--set", 'report_to=["wandb"]']
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == ("rlhfless: config error: report_to = ['wandb']: 'wandb' is named but its "
                   "package is not installed; pip install 'rlhfless[wandb]', or remove it\n")
    assert not list(tmp_path.iterdir())  # refused before any run directory


def test_a_tracker_failing_mid_run_is_said_and_dropped_and_the_others_go_on(monkeypatch,
                                                                              tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = Config(runs_dir=str(tmp_path), name="failing")
    run = RunDir.create(cfg)
    said: list[str] = []
    trackers = Trackers(said.append)
    trackers.open(["tensorboard", "wandb"], cfg, run.path)
    trackers.live["wandb"].run.finish()  # its run ends under it: the next log raises
    run.listeners.append(trackers)
    for step in (1, 2):
        run.append_metrics({"event": "iteration", "iteration": step, "reward_mean": step / 4})
    trackers.finish(None, failed=False)
    assert len(said) == 1 and said[0].startswith("report_to: wandb failed to log (UsageError")
    assert said[0].endswith("it gets nothing more from this run, metrics.jsonl has every record")
    assert [r["iteration"] for r in run.metrics()] == [1, 2]
    events = EventAccumulator(str(run.path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("iteration/reward_mean")] == [1, 2]


def test_wandb_keeps_an_iteration_logged_again_after_a_rollback(monkeypatch, tmp_path):
    from rlhfless.pipeline.report.trackers.wandb import WandbTracker

    monkeypatch.setenv("WANDB_MODE", "offline")
    tracker = WandbTracker(tmp_path, "again", {"iterations": 3})
    for step in (1, 2, 1):  # back to iteration 1, as after a rollback to it
        tracker.log({"iteration/reward_mean": step / 4}, step)
    tracker.finish(None, failed=False)
    rows = history(wandb_records(tmp_path))
    assert [(r["iteration"], r["iteration/reward_mean"]) for r in rows] == [
        (1, 0.25), (2, 0.5), (1, 0.25)]
