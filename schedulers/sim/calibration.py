"""Calibration: does the simulator predict a real run it has not seen?

``calibrate(run_dir)`` fits a ``Profile`` on some iterations of a recorded LocalCluster run
(``profile_from_run``), replays the *other* iterations in the simulator with the run's own
configuration (static pool, the logged assignment of groups to workers, prefix dedup, no
migration, every worker billed for the whole run), and compares per iteration:

- generation seconds: measured ``generate_wall_s`` vs simulated generate stage;
- update seconds: measured ``update_wall_s`` vs simulated update;
- worker-seconds over the predicted iterations: measured as workers (generation pool +
  trainer) times each iteration's wall time (end of the previous iteration to its end),
  simulated from the ledger.

The default split interleaves: after ``warmup`` iterations, fit on the odd ones and predict
the even ones. Interleaving keeps the machine's background load (shared cores) alike on
both sides of the split. The warm-up iterations are left out of both: the first updates of a
run are slower than the later ones (the trainer's allocator and kernels warming up), a
transient the simulator's steady state does not model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..profiles import Profile
from .profile_fit import profile_from_run
from .sim_policy import PolicyConfig
from .simulator import ClusterConfig, simulate
from .workloads import replay_trace

REPLAY = PolicyConfig("replay", billing="reserved", scaling="static", assignment="replay",
                      dedup=True, migration="none")


@dataclass(frozen=True)
class Calibration:
    """Measured vs simulated per predicted iteration, and the error summary."""

    fit_iterations: list[int]
    eval_iterations: list[int]
    profile: Profile
    rows: list[dict[str, float]] = field(default_factory=list)
    measured_worker_s: float = 0.0
    simulated_worker_s: float = 0.0

    def _err(self, key: str) -> np.ndarray:
        meas = np.array([r[f"measured_{key}"] for r in self.rows])
        sim = np.array([r[f"simulated_{key}"] for r in self.rows])
        return (sim - meas) / meas

    def errors(self) -> dict[str, float]:
        """Relative errors (simulated - measured) / measured: per-iteration mean absolute
        (``*_mape``), worst iteration (``*_max``), of the per-iteration means (``*_mean``),
        and of the total worker-seconds."""
        out: dict[str, float] = {}
        for key in ("gen_s", "update_s", "step_s"):
            e = self._err(key)
            meas = np.mean([r[f"measured_{key}"] for r in self.rows])
            sim = np.mean([r[f"simulated_{key}"] for r in self.rows])
            out[f"{key}_mape"] = float(np.mean(np.abs(e)))
            out[f"{key}_max"] = float(np.max(np.abs(e)))
            out[f"{key}_mean"] = float((sim - meas) / meas)
        out["worker_s"] = (self.simulated_worker_s - self.measured_worker_s) \
            / self.measured_worker_s
        return out

    def to_record(self) -> dict[str, Any]:
        return {"fit_iterations": self.fit_iterations, "eval_iterations": self.eval_iterations,
                "profile": self.profile.to_record(), "rows": self.rows,
                "measured_worker_s": self.measured_worker_s,
                "simulated_worker_s": self.simulated_worker_s, "errors": self.errors()}


def calibrate(run_dir: str | Path, fit_iterations: list[int] | None = None,
              eval_iterations: list[int] | None = None, warmup: int = 4) -> Calibration:
    """Fit on ``fit_iterations``, predict ``eval_iterations``; by default the odd and the
    even iterations after the first ``warmup`` (see the module docstring)."""
    run = Path(run_dir)
    trace = replay_trace(run)
    its = [b.iteration for b in trace.batches][warmup:]
    if fit_iterations is None:
        fit_iterations = [i for i in its if i % 2 == 1]
    if eval_iterations is None:
        eval_iterations = [i for i in its if i not in fit_iterations]
    overlap = sorted(set(fit_iterations) & set(eval_iterations))
    if overlap or not eval_iterations:
        raise ValueError(f"calibrate({run}): fit {fit_iterations} and predict "
                         f"{eval_iterations} must be disjoint and non-empty")
    config = json.loads((run / "config.json").read_text())
    n_gen = int(config.get("gen_workers", 1))
    profile = profile_from_run(run, fit_iterations)
    held = trace.select(eval_iterations)
    cluster = ClusterConfig(gpus=n_gen, train_gpus=1, colocated=False)
    result = simulate(held, profile, cluster, REPLAY)
    times = {m["iteration"]: m["time"] for m in trace.measured if "time" in m}
    rows, measured_ws = [], 0.0
    for sim, m in zip(result.iterations, held.measured, strict=True):
        it = sim.iteration
        wall = m["time"] - times[it - 1] if it - 1 in times else m["iteration_s"]
        measured_ws += (n_gen + 1) * wall
        rows.append({"iteration": it,
                     "measured_gen_s": m["generate_wall_s"], "simulated_gen_s": sim.gen_s,
                     "measured_update_s": m["update_wall_s"], "simulated_update_s": sim.update_s,
                     "measured_step_s": wall, "simulated_step_s": sim.step_s})
    return Calibration(list(fit_iterations), list(eval_iterations), profile, rows,
                       measured_ws, result.gpu_seconds())


def calibration_table(cal: Calibration) -> str:
    """Markdown table of the per-iteration comparison and the error summary."""
    lines = ["| iteration | gen measured | gen simulated | update measured | update simulated |",
             "|---:|---:|---:|---:|---:|"]
    for r in cal.rows:
        lines.append(f"| {r['iteration']} | {r['measured_gen_s']:.3f} | "
                     f"{r['simulated_gen_s']:.3f} | {r['measured_update_s']:.3f} | "
                     f"{r['simulated_update_s']:.3f} |")
    e = cal.errors()
    lines.append("")
    lines.append(f"generation: mean {e['gen_s_mean']:+.1%}, per-iteration MAPE "
                 f"{e['gen_s_mape']:.1%} (worst {e['gen_s_max']:.1%}); update: mean "
                 f"{e['update_s_mean']:+.1%}, MAPE {e['update_s_mape']:.1%} (worst "
                 f"{e['update_s_max']:.1%}); worker-seconds {e['worker_s']:+.1%}")
    return "\n".join(lines)
