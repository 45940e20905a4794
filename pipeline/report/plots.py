"""Figures of a run, from what the run directory holds (``run_data.RunData``).

Every function returns a ``matplotlib.figure.Figure`` built without pyplot (no global
figure state: safe in a report writer, a notebook, or a thread), or ``None`` when the run
has nothing to plot yet (the worker timeline needs ``ledger.json``, written when a run ends).

    reward_figure          mean reward per iteration, held-out accuracy per evaluation
    lengths_figure         response-length distributions per iteration
    stage_seconds_figure   busy seconds per stage per iteration (stacked), iteration wall time
    timeline_figure        one bar per worker lifetime, by pool; cold start hatched;
                           iteration spans shaded; scaling decisions marked
    worker_seconds_figure  worker·s (GPU·s on GPU pools) per pool per iteration
    tasks_figure           the trace's tasks of chosen iterations, a row per worker thread,
                           by stage, with the engine's phases inside them

and, for the simulator's results: ``policies_figure``, ``sweeps_figure``, ``plan_figure``.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from ..task_keys import STAGE_COLOURS
from .trace_events import US, read_trace, select

if TYPE_CHECKING:
    from .run_data import RunData

POOL_COLOURS = {"gen": "#fb8072", "train": "#b3de69"}
PHASE_COLOURS = {"cold_start": "#999999", "weight_fetch": "#6a3d9a", "prefill": "#1f78b4",
                 "decode": "#33a02c", "pause": "#e31a1c", "env_wait": "#ff7f00"}
OTHER = ("#cccccc", "#999999", "#d9d9d9", "#ccebc5", "#ffed6f", "#bebada")


def _colour(table: dict[str, str], key: str, i: int) -> str:
    return table.get(key, OTHER[i % len(OTHER)])


def png_bytes(fig: Figure, dpi: int = 110) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


def reward_figure(data: RunData) -> Figure | None:
    its = [m for m in data.iterations if "reward_mean" in m]
    if not its and not data.evals:
        return None
    fig = Figure(figsize=(7, 3.2))
    ax = fig.subplots()
    if its:
        x = [m["iteration"] for m in its]
        ax.plot(x, [m["reward_mean"] for m in its], "o-", ms=3, label="train reward (mean)")
    if data.evals:
        ax.plot([e["iteration"] for e in data.evals],
                [e["heldout_accuracy"] for e in data.evals], "s--", ms=4,
                label="held-out accuracy (greedy)")
    ax.set_xlabel("iteration")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("reward / accuracy")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    ax.set_title("Reward and held-out accuracy")
    return fig


def lengths_figure(data: RunData, max_iterations: int = 16) -> Figure | None:
    its = sorted(data.lengths)
    if not its:
        return None
    if len(its) > max_iterations:  # evenly spaced, first and last included
        its = [its[i] for i in np.linspace(0, len(its) - 1, max_iterations).round().astype(int)]
    fig = Figure(figsize=(7, 3.2))
    ax = fig.subplots()
    values = [data.lengths[i] if len(data.lengths[i]) else np.zeros(1) for i in its]
    ax.violinplot(values, positions=range(len(its)), showmedians=True, widths=0.8)
    ax.set_xticks(range(len(its)), [str(i) for i in its])
    ax.set_xlabel("iteration")
    ax.set_ylabel("response tokens")
    ax.grid(alpha=0.3, axis="y")
    ax.set_title("Response-length distribution per iteration")
    return fig


def _named_by_suffix(its: list[dict], suffix: str) -> list[str]:
    """Every ``name`` with a ``<name><suffix>`` key in ``its``, in first-seen order."""
    names: list[str] = []
    for m in its:
        names += [k[: -len(suffix)] for k in m
                  if k.endswith(suffix) and k[: -len(suffix)] not in names]
    return names


def _stacked_bars(ax, its: list[dict], names: list[str], suffix: str,
                  colours: dict[str, str], **style) -> np.ndarray:
    """One bar per iteration, stacking ``<name><suffix>`` of every name; returns the x."""
    x = np.array([m["iteration"] for m in its])
    bottom = np.zeros(len(its))
    for i, name in enumerate(names):
        secs = np.array([m.get(f"{name}{suffix}", 0.0) for m in its])
        ax.bar(x, secs, bottom=bottom, color=_colour(colours, name, i), label=name, **style)
        bottom += secs
    return x


def stage_seconds_figure(data: RunData) -> Figure | None:
    its = [m for m in data.iterations if any(k.endswith("_busy_s") for k in m)]
    if not its:
        return None
    stages = _named_by_suffix(its, "_busy_s")
    order = [s for s in STAGE_COLOURS if s in stages] + [s for s in stages
                                                         if s not in STAGE_COLOURS]
    fig = Figure(figsize=(7, 3.4))
    ax = fig.subplots()
    x = _stacked_bars(ax, its, order, "_busy_s", STAGE_COLOURS, edgecolor="white",
                      linewidth=0.5)
    if all("iteration_s" in m for m in its):
        ax.plot(x, [m["iteration_s"] for m in its], "k_", ms=14, mew=2,
                label="iteration wall time")
    ax.set_xlabel("iteration")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7, ncol=4, loc="upper left", bbox_to_anchor=(0, -0.2))
    ax.set_title("Seconds per stage (task compute time, summed over workers)")
    return fig


def timeline_figure(data: RunData, pools: list[str] | None = None) -> Figure | None:
    if not data.ledger:
        return None
    lives = [r for r in data.ledger["records"] if r["kind"] == "worker"
             and (pools is None or r["pool"] in pools)]
    if not lives:
        return None
    spans = [r for r in data.ledger["records"] if r["kind"] == "stage"]
    t0 = min(r["t_start"] for r in lives + spans)
    end = max([r["t_end"] or r["t_start"] for r in lives + spans])
    pool_order = sorted({r["pool"] for r in lives}, key=lambda p: (p != "gen", p))
    lives.sort(key=lambda r: (pool_order.index(r["pool"]), r["t_start"]))
    fig = Figure(figsize=(8, 0.9 + 0.32 * len(lives)))
    ax = fig.subplots()
    for row, r in enumerate(lives):
        colour = _colour(POOL_COLOURS, r["pool"], pool_order.index(r["pool"]))
        start, stop = r["t_start"] - t0, (r["t_end"] or end) - t0
        ready = (r["t_ready"] - t0) if r["t_ready"] else stop
        ax.barh(row, ready - start, left=start, color=colour, alpha=0.45, hatch="///",
                edgecolor=colour)
        ax.barh(row, stop - ready, left=ready, color=colour, edgecolor="black", linewidth=0.4)
    for i, s in enumerate(spans):
        ax.axvspan(s["t_start"] - t0, s["t_end"] - t0, color="#4c72b0",
                   alpha=0.08 if i % 2 else 0.15, lw=0)
    for d in data.decisions:
        if d.get("kind") == "scale" and d.get("t"):
            ax.axvline(d["t"] - t0, color="#4c72b0", ls=":", lw=1)
    ax.set_yticks(range(len(lives)), [r["name"] for r in lives], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the first worker was requested")
    handles = [Patch(color=_colour(POOL_COLOURS, p, i), label=f"pool {p}")
               for i, p in enumerate(pool_order)]
    handles += [Patch(facecolor="white", edgecolor="grey", hatch="///", label="cold start"),
                Patch(color="#4c72b0", alpha=0.15, label="iteration")]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title("Workers over time (dotted: scaling decisions)")
    return fig


def worker_seconds_figure(data: RunData) -> Figure | None:
    its = [m for m in data.iterations if any(k.endswith("_worker_s") for k in m)]
    if not its:
        return None
    pools = sorted(_named_by_suffix(its, "_worker_s"), key=lambda p: (p != "gen", p))
    fig = Figure(figsize=(7, 3.2))
    ax = fig.subplots()
    _stacked_bars(ax, its, pools, "_worker_s", POOL_COLOURS)
    ax.set_xlabel("iteration")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("worker·s (GPU·s on GPU pools)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    ax.set_title("Worker-seconds billed per iteration")
    return fig


# ---- simulation (``simulate.run_scenario`` / ``simulate.plan`` rows: plain dicts) ---------

def policies_figure(rows: list[dict]) -> Figure:
    """Mean step seconds and GPU·s per iteration of every simulated policy."""
    fig = Figure(figsize=(8, 0.6 + 0.3 * len(rows)))
    axes = fig.subplots(1, 2, sharey=True)
    labels = [r["label"] for r in rows]
    colours = ["#fb8072" if "ours" in label else "#80b1d3" for label in labels]
    for ax, key, title in ((axes[0], "step_s", "seconds per iteration"),
                           (axes[1], "gpu_s_per_iteration", "GPU·s per iteration")):
        ax.barh(range(len(rows)), [r[key] for r in rows], color=colours)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3, axis="x")
    axes[0].set_yticks(range(len(rows)), labels, fontsize=7)
    axes[0].invert_yaxis()
    return fig


def sweeps_figure(sweeps: dict[str, list[dict]]) -> Figure | None:
    """Speedup and GPU·s reduction against the baseline, per swept knob of our policy."""
    if not sweeps:
        return None
    fig = Figure(figsize=(3.2 * len(sweeps), 2.8))
    axes = np.atleast_1d(fig.subplots(1, len(sweeps)))
    for ax, (key, rows) in zip(axes, sweeps.items()):
        x = [float(r["label"].split("=", 1)[1]) for r in rows]
        ax.plot(x, [r["speedup"] for r in rows], "o-", label="speedup ×")
        ax.plot(x, [r["gpu_s_reduction"] for r in rows], "s--", label="GPU·s saved")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_xlabel(key)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Our policy against the baseline, one knob at a time", fontsize=9)
    return fig


def plan_figure(result: dict) -> Figure:
    """Plan mode: every candidate (pool size, λ) by step seconds and GPU·s per iteration,
    the goal (deadline or budget) as a line, the recommendation starred."""
    rows = result["candidates"]
    fig = Figure(figsize=(7, 3.6))
    ax = fig.subplots()
    points = ax.scatter([r["step_s"] for r in rows], [r["gpu_s_per_iteration"] for r in rows],
                        c=[r["gpus"] for r in rows], cmap="viridis", s=18 + 30 * np.array(
                            [r["lambda_cost"] for r in rows]))
    fig.colorbar(points, ax=ax, label="GPUs in the pool")
    if result.get("deadline_s") is not None:
        ax.axvline(result["deadline_s"], color="#d62728", ls="--", label="deadline")
    if result.get("budget_gpu_s") is not None:
        ax.axhline(result["budget_gpu_s"], color="#d62728", ls="--", label="budget")
    best = result.get("recommendation")
    if best:
        ax.plot(best["step_s"], best["gpu_s_per_iteration"], "*", ms=16, color="#ff7f0e",
                label=f"plan: {best['gpus']} GPUs, λ={best['lambda_cost']:g}")
    ax.set_xlabel("seconds per iteration")
    ax.set_ylabel("GPU·s per iteration")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"Plan for {result.get('scenario', '')} (marker size: λ)")
    return fig


def tasks_figure(data: RunData) -> Figure | None:
    """The trace's tasks (``trace.json``) of iterations ``data.traced`` (default: the last),
    the held-out graph's left out: a row per worker thread, a bar per task coloured by stage,
    and inside it a thin bar per engine phase."""
    path = data.path / "trace.json"
    if not path.exists() or not data.iterations:
        return None
    first, last = data.traced or (data.iterations[-1]["iteration"],) * 2
    events = select(read_trace(path), first, last)
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    spans = [e for e in events if e["ph"] == "X" and e["cat"] in ("task", "phase")
             and not e["args"].get("tag")]
    if not spans:
        return None
    rows = sorted({(names[e["pid"]], e["tid"]) for e in spans})
    t0 = min(e["ts"] for e in spans)
    fig = Figure(figsize=(8, 1.2 + 0.32 * len(rows)))
    ax = fig.subplots()
    shown: dict[str, dict] = {}
    for e in spans:
        row, left, width = rows.index((names[e["pid"]], e["tid"])), (e["ts"] - t0) / US, \
            e["dur"] / US
        if e["cat"] == "task":
            style = {"color": _colour(STAGE_COLOURS, e["name"], len(shown)), "height": 0.8,
                     "edgecolor": "black", "linewidth": 0.3}
        else:
            style = {"color": PHASE_COLOURS.get(e["name"], "black"), "height": 0.3}
        ax.barh(row, max(width, 1e-3), left=left, **style)
        shown.setdefault(e["name"], style)
    ax.set_yticks(range(len(rows)), [name for name, _ in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"seconds since the first task of iteration {first}")
    ax.legend(handles=[Patch(color=style["color"], label=name)
                       for name, style in shown.items()],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    span = f"iteration {first}" if first == last else f"iterations {first} to {last}"
    ax.set_title(f"Tasks of {span} (thin: the engine's phases)")
    return fig


FIGURES = {
    "reward": ("Reward and held-out accuracy", reward_figure),
    "lengths": ("Response lengths", lengths_figure),
    "stages": ("Seconds per stage", stage_seconds_figure),
    "timeline": ("Worker timeline", timeline_figure),
    "worker_seconds": ("GPU·s (worker·s) per iteration", worker_seconds_figure),
    "tasks": ("Tasks of chosen iterations", tasks_figure),
}
