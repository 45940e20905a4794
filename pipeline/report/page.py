"""``rlhfless report RUN``: one static HTML page about a run, its plots beside it.

    rlhfless report runs/<name> [-o DIR] [--iterations A:B]   # default DIR: runs/<name>/report/

writes ``DIR/index.html`` and one PNG per figure (``plots.FIGURES``): reward and held-out
accuracy, response-length distributions, seconds per stage, the worker timeline and the
worker-seconds (GPU·s) per iteration, and the trace's tasks of chosen iterations
(``--iterations``; default: the last); then tables of where each pool's worker-seconds went
per iteration (busy, waiting, idle shares and the bound: ``pool_time.py``), the cost
ledger and the scaling decisions, and — while the run is live — a link to its Dask
dashboard (``dashboard.json``, written by the training loop). A figure the run cannot
show yet (no ``ledger.json`` before the run ends) is listed as such, never drawn empty.
The page references its images by relative path, so the directory can be copied as a
whole.

``RunData.load`` (``run_data.py``) is also what the notebooks plot from. matplotlib (the
``notebooks`` and ``dev`` extras) is imported only when figures are drawn.
"""

from __future__ import annotations

import html
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from .run_data import RunData

SUMMARY_KEYS = ("algorithm", "policy", "mode", "cluster", "backend", "batch_prompts",
                "n_samples", "max_new_tokens", "gen_workers", "lambda_cost", "tau")


def ledger_rows(data: RunData) -> list[dict]:
    """Per pool: workers started, worker-seconds, cold starts, cost (from ledger.json)."""
    if not data.ledger:
        return []
    rows = []
    prices = data.ledger.get("prices", {})
    for pool in prices:
        lives = [r for r in data.ledger["records"]
                 if r["kind"] == "worker" and r["pool"] == pool]
        colds = [r["cold_start_s"] for r in lives if r["cold_start_s"] is not None]
        rows.append({"pool": pool, "workers started": len(lives),
                     "worker·s": sum(r["worker_s"] or 0.0 for r in lives),
                     "mean cold start s": float(np.mean(colds)) if colds else None,
                     "price per worker·s": prices[pool],
                     "cost": sum(r["cost"] or 0.0 for r in lives)})
    return rows


def pool_time_rows(data: RunData) -> list[dict]:
    """Per iteration: its bound and each pool's busy, waiting and idle shares (metrics)."""
    parts = [f"{pool}_{part}_share" for pool in ("gen", "train")
             for part in ("busy", "waiting", "idle")]
    return [{"iteration": m["iteration"], "bound": m["bound"]}
            | {p.removesuffix("_share").replace("_", " "): m.get(p) for p in parts}
            for m in data.iterations if "bound" in m]


def decision_rows(data: RunData) -> list[dict]:
    """The decision log with times relative to the first decision."""
    if not data.decisions:
        return []
    t0 = min(d["t"] for d in data.decisions)
    keep = ("iteration", "kind", "pool", "from", "to", "worker", "source", "target",
            "sequences", "predicted_s", "actual_s", "predicted_worker_s", "actual_worker_s",
            "reason")
    return [{"t": d["t"] - t0} | {k: d[k] for k in keep if k in d}
            for d in sorted(data.decisions, key=lambda d: d["t"])]


def html_table(rows: list[dict], max_rows: int = 200) -> str:
    """A plain HTML table of ``rows`` (the union of their keys as columns)."""
    if not rows:
        return "<p><em>none</em></p>"
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]

    def cell(v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, float):
            return f"{v:.3g}"
        return html.escape(str(v))

    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{cell(r.get(c))}</td>" for c in columns) + "</tr>"
                   for r in rows[:max_rows])
    more = f"<p>… {len(rows) - max_rows} more rows</p>" if len(rows) > max_rows else ""
    return f"<table><tr>{head}</tr>{body}</table>{more}"


def _summary(data: RunData) -> list[dict]:
    out = {k: data.config[k] for k in SUMMARY_KEYS if k in data.config}
    out["iterations done"] = len(data.iterations)
    if data.iterations:
        out["last reward"] = data.iterations[-1].get("reward_mean")
    if data.evals:
        out["held-out accuracy"] = (f"{data.evals[0]['heldout_accuracy']:.3f} → "
                                    f"{data.evals[-1]['heldout_accuracy']:.3f}")
    if data.ledger:
        out["worker·s"] = data.ledger["totals"]["worker_s"]
        out["cost"] = data.ledger["totals"]["cost"]
    return [out]


STYLE = """body{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}
table{border-collapse:collapse;font-size:12px;margin:0.5em 0}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}th{background:#f3f3f3}
img{max-width:100%;border:1px solid #eee}.live{background:#e8f5e9;padding:0.5em}"""


def write_report(run: str | Path, out_dir: str | Path | None = None,
                 iterations: tuple[float, float] | None = None) -> Path:
    """Write ``index.html`` and its PNGs for the run at ``run``, drawing the tasks of
    ``iterations`` (first, last; default: the last one); returns the HTML path."""
    try:
        from .plots import FIGURES, png_bytes
    except ImportError as err:
        raise ImportError("rlhfless report draws with matplotlib: "
                          "pip install 'rlhfless[notebooks]'") from err
    data = RunData.load(run)
    data.traced = iterations
    out = Path(out_dir) if out_dir is not None else data.path / "report"
    out.mkdir(parents=True, exist_ok=True)
    name = html.escape(data.path.name)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{name}</title>"
             f"<style>{STYLE}</style></head><body><h1>Run {name}</h1>"]
    if data.live and not data.dashboard["link"]:
        parts.append("<p class='live'>This run is live (its Dask dashboard is off).</p>")
    elif data.live:
        link = html.escape(data.dashboard["link"])
        parts.append(f"<p class='live'>This run is live: <a href='{link}'>Dask dashboard</a>"
                     f" ({link})</p>")
    elif data.dashboard and data.dashboard["link"]:
        parts.append("<p>The run has ended; its Dask dashboard is gone.</p>")
    parts.append(html_table(_summary(data)))
    for key, (title, draw) in FIGURES.items():
        parts.append(f"<h2>{html.escape(title)}</h2>")
        fig = draw(data)
        if fig is None:
            parts.append("<p><em>not available for this run yet</em></p>")
            continue
        (out / f"{key}.png").write_bytes(png_bytes(fig))
        parts.append(f"<img src='{key}.png' alt='{html.escape(title)}'>")
    parts.append("<h2>Where the pools' time went</h2>" + html_table(pool_time_rows(data)))
    parts.append("<h2>Cost ledger</h2>" + html_table(ledger_rows(data)))
    parts.append("<h2>Scaling decisions</h2>" + html_table(decision_rows(data)))
    parts.append(f"<h2>Configuration</h2><pre>{html.escape(json.dumps(data.config, indent=1))}"
                 "</pre></body></html>")
    page = out / "index.html"
    page.write_text("\n".join(parts), encoding="utf-8")
    return page


def run_from_args(args: Any) -> int:
    try:
        print(write_report(args.run, args.output, args.iterations))
    except (FileNotFoundError, ImportError, ValueError) as err:  # ValueError: a bad file
        print(f"rlhfless: report: {err}", file=sys.stderr)
        return 2
    return 0
