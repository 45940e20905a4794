"""Helpers the notebooks call, so that the notebooks themselves hold no logic.

* ``LivePlot``: pass it as ``train(..., on_metrics=LivePlot(cfg.iterations))``; it redraws one
  figure in place after every iteration and evaluation — a progress line (iteration i of n,
  seconds so far) over the reward and held-out accuracy curves;
* ``graph_image``: the iteration graph of a config (``train/render.py``) as an inline image;
* ``table``: rows (dicts) as an HTML table; ``iterations_table``: chosen metrics of a run's
  iterations, one row each;
* ``scenario``: one of the simulator's built-in scenarios, with fewer iterations if asked.

Needs IPython (the ``notebooks`` extra); it is meant to be imported in a notebook kernel.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from IPython.display import HTML, Image, display
from matplotlib.figure import Figure

from .config import Config
from .report.page import html_table
from .report.run_data import RunData
from .sim.simulate import Scenario, paper_scenarios
from .train.render import render_graph


class LivePlot:
    """A metrics listener that keeps one figure up to date in the notebook output."""

    def __init__(self, iterations: int) -> None:
        self.iterations = iterations
        self.started = time.time()
        self.rewards: list[tuple[int, float]] = []
        self.accuracy: list[tuple[int, float]] = []
        self.handle = display(HTML("<em>starting the cluster…</em>"), display_id=True)

    def __call__(self, record: dict) -> None:
        event = record.get("event")
        if event == "iteration" and "reward_mean" in record:
            self.rewards.append((record["iteration"], record["reward_mean"]))
        elif event == "eval":
            self.accuracy.append((record["iteration"], record["heldout_accuracy"]))
        else:
            return
        self.handle.update(self.figure())

    def figure(self) -> Figure:
        fig = Figure(figsize=(6.5, 2.8))
        ax = fig.subplots()
        if self.rewards:
            ax.plot(*zip(*self.rewards), "o-", ms=3, label="train reward")
        if self.accuracy:
            ax.plot(*zip(*self.accuracy), "s--", ms=4, label="held-out accuracy")
        done = self.rewards[-1][0] if self.rewards else 0
        ax.set_xlim(-0.2, self.iterations + 0.2)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
        ax.set_title(f"iteration {done}/{self.iterations} · {time.time() - self.started:.0f} s",
                     fontsize=9)
        return fig


def graph_image(cfg: Config) -> Image:
    """The graph of one iteration of ``cfg`` (stages coloured, one branch per shard)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = render_graph(cfg, str(Path(tmp) / "iteration.png"))
        return Image(data=Path(path).read_bytes(), format="png")


def table(rows: list[dict], max_rows: int = 200) -> HTML:
    return HTML(html_table(rows, max_rows))


def iterations_table(data: RunData, keys: Sequence[str]) -> HTML:
    """The ``keys`` of each iteration's metrics record, one row per iteration (blank where
    a record lacks one)."""
    return table([{key: record.get(key) for key in keys} for record in data.iterations])


def scenario(name: str, iterations: int | None = None) -> Scenario:
    """A built-in scenario by name (``paper-physical``, ``paper-simulated``)."""
    known = {sc.name: sc for sc in paper_scenarios()}
    if name not in known:
        raise ValueError(f"scenario {name!r}: choose one of {sorted(known)}")
    sc = known[name]
    if iterations is None:
        return sc
    return dataclasses.replace(sc, workload=dataclasses.replace(sc.workload,
                                                                iterations=iterations))
