"""``rlhfless report`` on a real finished run: every image of the page is a PNG that decodes
to a non-blank picture, every figure of ``plots.FIGURES`` is there, the tasks figure draws
the trace of the iterations asked, and the dashboard is linked only while the run is
live."""

from __future__ import annotations

import json
import os
import re
import socket
import struct
from pathlib import Path

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib", reason="the report draws with matplotlib")
from matplotlib.image import imread  # noqa: E402

from rlhfless.pipeline.cli import main  # noqa: E402
from rlhfless.pipeline.report.page import RunData, write_report  # noqa: E402
from rlhfless.pipeline.report.plots import FIGURES, tasks_figure  # noqa: E402
from rlhfless.pipeline.report.trace_events import read_trace  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def check_png(path: Path) -> tuple[int, int]:
    """(width, height) of a valid PNG whose pixels are not all one colour."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", path
    width, height = struct.unpack(">II", data[16:24])
    assert width > 100 and height > 100, (path, width, height)
    pixels = imread(path)
    assert pixels.shape[:2] == (height, width) and float(np.std(pixels)) > 0.01, path
    return width, height


def test_report_of_a_finished_run_has_every_figure_as_a_valid_png(finished_run, tmp_path):
    page = write_report(finished_run, tmp_path / "report")
    html = page.read_text()
    sources = re.findall(r"<img src='([^']+)'", html)
    assert sorted(sources) == sorted(f"{key}.png" for key in FIGURES)
    for src in sources:
        check_png(page.parent / src)
    assert "not available" not in html
    assert "Dask dashboard</a>" not in html and "has ended" in html  # the run is over
    for heading in ("Where the pools' time went", "Cost ledger", "Scaling decisions",
                    "Configuration"):
        assert f"<h2>{heading}</h2>" in html
    bounds = [m["bound"] for m in RunData.load(finished_run).iterations]  # metrics.jsonl
    assert len(bounds) == 2 and all(f"<td>{b}</td>" in html for b in bounds)
    assert html.count("<tr>") > 5  # ledger rows, decisions, summary


@pytest.mark.parametrize("traced, drawn", [(None, 2), ((1, 1), 1)])
def test_the_tasks_figure_draws_the_traces_spans_of_the_iterations_asked(finished_run, traced,
                                                                         drawn):
    data = RunData.load(finished_run)
    data.traced = traced
    [ax] = tasks_figure(data).axes
    events = read_trace(finished_run / "trace.json")
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    spans = [e for e in events if e["ph"] == "X" and e["cat"] in ("task", "phase")
             and e["args"].get("iteration") == drawn and not e["args"]["tag"]]
    assert {e["cat"] for e in spans} == {"task", "phase"}
    assert len(ax.patches) == len(spans)  # a bar each, no other
    workers = [t.get_text() for t in ax.get_yticklabels()]
    assert sorted(set(workers)) == sorted({names[e["pid"]] for e in spans})
    assert any(w.startswith("gen-") for w in workers) and any(
        w.startswith("train-") for w in workers)
    assert ax.get_title().startswith(f"Tasks of iteration {drawn} ")


def test_rlhfless_report_draws_the_tasks_of_the_iterations_asked(finished_run, tmp_path):
    assert main(["report", str(finished_run), "-o", str(tmp_path), "--iterations", "1:1"]) == 0
    check_png(tmp_path / "tasks.png")
    assert "<h2>Tasks of chosen iterations</h2>" in (tmp_path / "index.html").read_text()


def test_run_data_reads_what_the_figures_need(finished_run):
    data = RunData.load(finished_run)
    assert [m["iteration"] for m in data.iterations] == [1, 2]
    assert [e["iteration"] for e in data.evals] == [0, 1, 2]
    assert sorted(data.lengths) == [1, 2] and all(len(v) == 24 for v in data.lengths.values())
    assert data.ledger and {d["kind"] for d in data.decisions} >= {"scale", "release"}
    assert data.dashboard["link"].startswith("http") and not data.live


def live_copy(finished_run: Path, live: Path, link: str) -> Path:
    """The config, metrics and trace (not closed yet) of ``finished_run`` in ``live``, as a
    run of this process that serves its dashboard at ``link`` (empty: none)."""
    live.mkdir()
    for name in ("config.json", "metrics.jsonl"):
        (live / name).write_text((finished_run / name).read_text())
    trace = (finished_run / "trace.json").read_text().rstrip().removesuffix("]")
    (live / "trace.json").write_text(trace)
    (live / "dashboard.json").write_text(json.dumps(
        {"link": link, "host": socket.gethostname(), "pid": os.getpid(), "started": 0.0}))
    return live


def test_a_live_run_links_its_dashboard(finished_run, tmp_path):
    link = "http://127.0.0.1:8787/status"
    live = live_copy(finished_run, tmp_path / "live", link)
    html = write_report(live).read_text()
    assert f"<a href='{link}'>Dask dashboard</a>" in html
    assert html.count("not available for this run yet") == 2  # no rollouts, no ledger yet
    for src in re.findall(r"<img src='([^']+)'", html):
        check_png(live / "report" / src)


def test_cli_report_and_a_clear_error_for_a_non_run(finished_run, tmp_path, capsys):
    assert main(["report", str(finished_run), "-o", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "index.html").exists()
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rlhfless: report:") and "no metrics.jsonl" in err and "\n" not in err


def test_a_live_run_without_a_dashboard_links_none(finished_run, tmp_path):
    html = write_report(live_copy(finished_run, tmp_path / "live", "")).read_text()
    assert "its Dask dashboard is off" in html and "<a href=" not in html
