"""The simulation report: markdown tables, ``results.json`` and PNG plots.

``write_report(reports, out_dir)`` takes what ``simulate.run_scenario`` returns for each
scenario and writes ``report.md`` (headline vs the paper, one table per scenario with every
baseline and ablation, the sweeps), ``results.json`` (the same rows), and per scenario three
plots comparing the verl-like baseline with our policy: step time per iteration, GPU-seconds
per iteration, and GPUs billed vs busy over time. matplotlib is an optional dependency (the
``dev`` and ``notebooks`` extras); it is imported only when plotting.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlhfless.schedulers.simulator import SimResult

OURS = "rlhfless (ours)"
VERL = "verl-like"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def headline_table(reports: list[dict[str, Any]]) -> str:
    """Our speedup and GPU-s reduction vs the verl-like baseline, the paper's beside them."""
    lines = ["| setting | speedup (ours) | speedup (paper) | GPU-s reduction (ours) | "
             "GPU-s reduction (paper) |", "|---|---:|---:|---:|---:|"]
    for rep in reports:
        sc = rep["scenario"]
        row = next(r for r in rep["table"] if r["label"] == OURS)
        paper = sc.get("paper") or {}
        setting = (f"{sc['name']}: {sc['profile']['name']} x {sc['gpus'] // sc['profile']['tp']}"
                   f" workers ({sc['gpus']} GPUs), {sc['workload']['name']} "
                   f"{sc['workload']['batch_prompts']}x{sc['workload']['n_samples']}")
        ps = f"{paper['speedup']:.2f}x" if "speedup" in paper else "-"
        pr = _pct(paper["reduction"]) if "reduction" in paper else "-"
        lines.append(f"| {setting} | {row['speedup']:.2f}x | {ps} | "
                     f"{_pct(row['gpu_s_reduction'])} | {pr} |")
    return "\n".join(lines)


def baselines_table(reports: list[dict[str, Any]]) -> str:
    """Our GPU-s saving over the RLHFuse-like baseline (paper: 12.8 %) and the share of the
    Oracle's GPU-s reduction we reach (paper: over 90 %)."""
    lines = ["| setting | GPU-s saved vs rlhfuse-like (ours / paper) | share of oracle's "
             "reduction (ours / paper) |", "|---|---:|---:|"]
    for rep in reports:
        rows = {r["label"]: r for r in rep["table"]}
        ours, fuse, oracle = rows[OURS], rows["rlhfuse-like"], rows["oracle"]
        saved = 1.0 - ours["gpu_s"] / fuse["gpu_s"]
        share = ours["gpu_s_reduction"] / oracle["gpu_s_reduction"] \
            if oracle["gpu_s_reduction"] > 0 else float("nan")
        lines.append(f"| {rep['scenario']['name']} | {_pct(saved)} / 12.8% | "
                     f"{_pct(share)} / >90% |")
    return "\n".join(lines)


def policy_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| policy | step s | gen s | update s | GPU-s / iteration | speedup | "
             "GPU-s reduction | workers | migrations | utilisation | plan ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['step_s']:.1f} | {r['gen_s']:.1f} | {r['update_s']:.1f} | "
            f"{r['gpu_s_per_iteration']:.0f} | {r['speedup']:.3f}x | "
            f"{_pct(r['gpu_s_reduction'])} | {r['mean_workers']:.1f} | {r['migrations']} | "
            f"{_pct(r['utilisation'])} | {r['plan_ms']:.1f} |")
    return "\n".join(lines)


def sweep_table(key: str, rows: list[dict[str, Any]]) -> str:
    lines = [f"| {key} | step s | GPU-s / iteration | speedup | GPU-s reduction | workers |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['label'].split('=', 1)[1]} | {r['step_s']:.1f} | "
                     f"{r['gpu_s_per_iteration']:.0f} | {r['speedup']:.3f}x | "
                     f"{_pct(r['gpu_s_reduction'])} | {r['mean_workers']:.1f} |")
    return "\n".join(lines)


def scenario_section(rep: dict[str, Any]) -> str:
    sc = rep["scenario"]
    wl, pol = sc["workload"], sc["policy"]
    parts = [
        f"## {sc['name']}",
        "",
        f"{sc['profile']['name']} on {sc['gpus']} GPUs (tp {sc['profile']['tp']}), learner "
        f"on {sc['train_gpus'] or sc['gpus']} GPUs; workload {wl['name']}: "
        f"{wl['batch_prompts']} prompts x {wl['n_samples']} samples, {wl['iterations']} "
        f"iterations, response p50 {wl['response_p50']:.0f} / p99 {wl['response_p99']:.0f} "
        f"tokens (cap {wl['max_response_tokens']}). Our policy: lambda {pol['lambda_cost']}, "
        f"tau {pol['tau']}, EWMA alpha {pol['ewma_alpha']}, keep-alive {pol['keep_alive']}.",
        "",
        policy_table(rep["table"]),
    ]
    for key, rows in rep.get("sweeps", {}).items():
        parts += ["", f"Sweep of {key} (our policy, others at their defaults):", "",
                  sweep_table(key, rows)]
    return "\n".join(parts)


def plot_scenario(name: str, results: dict[str, SimResult], out_dir: Path) -> list[Path]:
    """Step time, GPU-s per iteration, and utilisation over time; returns the PNG paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError(
            "rlhfless simulate: the plots need matplotlib, which is not installed; install "
            "it (pip install 'rlhfless[dev]' or 'rlhfless[notebooks]') or pass --no-plots"
        ) from err
    paths = []
    for key, ylabel, fname in (("step_s", "step time (s)", "step-time"),
                               ("gpu_s", "GPU-seconds billed", "gpu-seconds")):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for label, res in results.items():
            its = [r.iteration for r in res.iterations]
            ax.plot(its, [getattr(r, key) for r in res.iterations], marker=".", label=label)
        ax.set_xlabel("iteration")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{name}: {ylabel} per iteration")
        ax.legend()
        fig.tight_layout()
        paths.append(out_dir / f"{name}-{fname}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    fig, axes = plt.subplots(len(results), 1, figsize=(7, 2.6 * len(results)), squeeze=False)
    for ax, (label, res) in zip(axes[:, 0], results.items(), strict=True):
        u = res.utilisation()
        ax.fill_between(u["t"], u["billed_gpus"], step="mid", alpha=0.3, label="GPUs billed")
        ax.plot(u["t"], u["busy_gpus"], drawstyle="steps-mid", label="GPUs busy")
        ax.set_ylabel("GPUs")
        ax.set_title(f"{label}: utilisation {res.summary()['utilisation']:.0%}")
        ax.legend(loc="upper right")
    axes[-1, 0].set_xlabel("simulated time (s)")
    fig.tight_layout()
    paths.append(out_dir / f"{name}-utilisation.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def write_report(reports: list[dict[str, Any]], out_dir: Path, plots: bool = True) -> str:
    """Write ``report.md``, ``results.json`` and the plots; returns the printed text."""
    out_dir.mkdir(parents=True, exist_ok=True)
    images: list[Path] = []
    if plots:
        for rep in reports:
            images += plot_scenario(rep["scenario"]["name"], rep["results"], out_dir)
    head = ("# rlhfless simulation report\n\nOur elastic policy vs the verl-like baseline "
            "(static colocated pool, no prefix dedup, even split, billed for the whole run); "
            "the paper's figures are RLHFless's reported ones.\n\n" + headline_table(reports)
            + "\n\n" + baselines_table(reports))
    body = "\n\n".join(scenario_section(rep) for rep in reports)
    figs = "\n".join(f"![{p.stem}]({p.name})" for p in images)
    (out_dir / "report.md").write_text(f"{head}\n\n{body}\n\n{figs}\n")
    clean = [{k: v for k, v in rep.items() if k != "results"} for rep in reports]
    (out_dir / "results.json").write_text(json.dumps(clean, indent=1, default=float))
    return f"{head}\n\n{body}"
