"""The simulation report: markdown tables, ``results.json`` and PNG plots.

``write_report(reports, out_dir, pat=...)`` takes what ``simulate.run_scenario`` returns for
each scenario (and ``simulate.run_pat`` for PAT's settings) and writes ``report.md``
(headline vs the paper, one table per scenario with every baseline, ablation and the upper
bound, the sweeps, PAT vs static TP, the training modes vs sync), ``results.json``,
``pat.json`` and ``modes.json`` (the same rows), and
per scenario three
plots comparing the verl baselines with our policy: step time per iteration, GPU-seconds
per iteration, and GPUs billed vs busy over time. matplotlib is an optional dependency (the
``dev`` and ``notebooks`` extras); it is imported only when plotting.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlhfless.schedulers.sim.simulator import SimResult

OURS = "rlhfless (ours)"
PAPER_ROW = "+cut-and-migrate"  # the ablation row with the paper's four mechanisms
VERL = "verl-0.3"
TUNED = "verl-tuned"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _setting(rep: dict[str, Any]) -> str:
    sc = rep["scenario"]
    return (f"{sc['name']}: {sc['profile']['name']} x {sc['gpus'] // sc['profile']['tp']}"
            f" workers ({sc['gpus']} GPUs), {sc['workload']['name']} "
            f"{sc['workload']['batch_prompts']}x{sc['workload']['n_samples']}")


def headline_table(reports: list[dict[str, Any]]) -> str:
    """Speedup and GPU-s reduction vs verl-0.3 (ours, the paper's mechanisms alone, the
    bound of any scheduler, the paper's), ours vs verl-tuned, and ours at the lambda where
    our speed meets the paper's (``simulate.at_paper_speed``)."""
    lines = ["| setting | speedup vs verl-0.3: ours / paper's mechanisms / bound / paper | "
             "GPU-s reduction vs verl-0.3: ours / paper's mechanisms / bound / paper | "
             "vs verl-tuned: speedup, GPU-s reduction (ours) | ours at the paper's speed: "
             "lambda, speedup, GPU-s reduction vs verl-0.3 |", "|---|---|---|---|---|"]
    for rep in reports:
        rows = {r["label"]: r for r in rep["table"]}
        ours, mech, bound = rows[OURS], rows[PAPER_ROW], rep["bound"]
        paper = rep["scenario"].get("paper") or {}
        ps = f"{paper['speedup']:.2f}x" if "speedup" in paper else "-"
        pr = _pct(-paper["reduction"]) if "reduction" in paper else "-"
        lines.append(
            f"| {_setting(rep)} | {ours['speedup']:.2f}x / {mech['speedup']:.2f}x / "
            f"{bound['speedup']:.2f}x / {ps} | {_pct(-ours['gpu_s_reduction'])} / "
            f"{_pct(-mech['gpu_s_reduction'])} / {_pct(-bound['gpu_s_reduction'])} / {pr} | "
            f"{ours['speedup_tuned']:.2f}x, {_pct(-ours['gpu_s_reduction_tuned'])} | "
            f"{_operating_point(rep.get('at_paper_speed'))} |")
    return "\n".join(lines)


def _operating_point(point: dict[str, float] | None) -> str:
    if not point:
        return "-"
    return (f"{point['lambda_cost']:.3f}, {point['speedup']:.2f}x, "
            f"{_pct(-point['gpu_s_reduction'])}")


def baselines_table(reports: list[dict[str, Any]]) -> str:
    """Our GPU-s saving over the RLHFuse-like baseline (paper: 12.8 %), the share of the
    Oracle's GPU-s reduction we reach (paper: over 90 %), and the baselines' TPs."""
    lines = ["| setting | GPU-s saved vs rlhfuse-like (ours / paper) | share of oracle's "
             "reduction (ours / paper) | verl-0.3 TP | verl-tuned TP |",
             "|---|---:|---:|---:|---:|"]
    for rep in reports:
        rows = {r["label"]: r for r in rep["table"]}
        ours, fuse, oracle = rows[OURS], rows["rlhfuse-like"], rows["oracle"]
        saved = 1.0 - ours["gpu_s"] / fuse["gpu_s"]
        share = ours["gpu_s_reduction"] / oracle["gpu_s_reduction"] \
            if oracle["gpu_s_reduction"] > 0 else float("nan")
        tp = rep["baseline_tp"]
        lines.append(f"| {rep['scenario']['name']} | {_pct(saved)} / 12.8% | "
                     f"{_pct(share)} / >90% | {tp[VERL]} | {tp[TUNED]} |")
    return "\n".join(lines)


def policy_table(rows: list[dict[str, Any]], bound: dict[str, float] | None = None) -> str:
    lines = ["| policy | step s | gen s | update s | GPU-s / iteration | speedup vs 0.3 | "
             "GPU-s vs 0.3 | speedup vs tuned | GPU-s vs tuned | workers | migrations | "
             "utilisation | plan ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['step_s']:.1f} | {r['gen_s']:.1f} | {r['update_s']:.1f} | "
            f"{r['gpu_s_per_iteration']:.0f} | {r['speedup']:.3f}x | "
            f"{_pct(-r['gpu_s_reduction'])} | {r['speedup_tuned']:.3f}x | "
            f"{_pct(-r['gpu_s_reduction_tuned'])} | {r['mean_workers']:.1f} | "
            f"{r['migrations']} | {_pct(r['utilisation'])} | {r['plan_ms']:.1f} |")
    if bound:
        lines.append(
            f"| upper bound (any scheduler, given the update) | {bound['step_s']:.1f} | | | "
            f"{bound['gpu_s_per_iteration']:.0f} | {bound['speedup']:.3f}x | "
            f"{_pct(-bound['gpu_s_reduction'])} | {bound['speedup_tuned']:.3f}x | "
            f"{_pct(-bound['gpu_s_reduction_tuned'])} | | | | |")
    return "\n".join(lines)


def sweep_table(key: str, rows: list[dict[str, Any]]) -> str:
    lines = [f"| {key} | step s | GPU-s / iteration | speedup vs 0.3 | GPU-s vs 0.3 | "
             "workers | migrations |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['label'].split('=', 1)[1]} | {r['step_s']:.1f} | "
                     f"{r['gpu_s_per_iteration']:.0f} | {r['speedup']:.3f}x | "
                     f"{_pct(-r['gpu_s_reduction'])} | {r['mean_workers']:.1f} | "
                     f"{r['migrations']} |")
    return "\n".join(lines)


def _gen_share(rep: dict[str, Any], label: str) -> float:
    row = next(r for r in rep["table"] if r["label"] == label)
    return row["gen_s"] / row["step_s"]


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
        f"tau {pol['tau']}, EWMA alpha {pol['ewma_alpha']}, "
        f"keep-alive {pol['keep_alive_s']} s (< 0: break-even). "
        f"Calibration: {sc.get('calibration', '-')}; verl-0.3 here spends "
        f"{_pct(_gen_share(rep, VERL))} of its step in generation.",
        "",
        policy_table(rep["table"], rep.get("bound")),
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


def pat_table(pats: list[dict[str, Any]]) -> str:
    """PAT against static TP, per setting and TP, PAT's own headline beside, PAT against
    the fastest static TP, and the bound: the generation change if the longest sequence ran
    alone at the fastest TP."""
    lines = ["| setting | static TP | generation s: static -> PAT | change (PAT paper: "
             "-34.6%) | vs fastest static TP | bound | step s: static -> PAT | change (PAT "
             "paper: -27.2%) | merges |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rep in pats:
        sc = rep["scenario"]
        for r in rep["rows"]:
            best = " (fastest static)" if r["tp"] == rep["best_static_tp"] else ""
            lines.append(
                f"| {sc['name']}: {sc['profile']['name']}, {sc['gpus']} GPUs, "
                f"{sc['workload']['name']} {sc['workload']['batch_prompts']}x"
                f"{sc['workload']['n_samples']} | {r['tp']}{best} | {r['static_gen_s']:.1f} -> "
                f"{r['pat_gen_s']:.1f} | {_pct(r['gen_change'])} | "
                f"{_pct(r['gen_change_vs_fastest'])} | {_pct(r['bound_gen_change'])} | "
                f"{r['static_step_s']:.1f} -> "
                f"{r['pat_step_s']:.1f} | {_pct(r['step_change'])} | {r['reconfigurations']} |")
    return "\n".join(lines)


def modes_table(modes: list[dict[str, Any]]) -> str:
    """Trained samples per second of each mode against sync, the papers' figures beside."""
    lines = ["| setting | mode | samples/s | vs sync | paper (vs its sync) | replayed | "
             "max staleness | GPUs gen + learner |", "|---|---|---:|---:|---|---:|---:|---|"]
    for rep in modes:
        sc = rep["scenario"]
        where = (f"{sc['name']}: {sc['profile']['name']}, {sc['gpus']} GPUs, "
                 f"{sc['workload']['name']}")
        for r in rep["rows"]:
            gpus = (f"{r['gen_gpus']} + {r['train_gpus']}" if "gen_gpus" in r
                    else f"{sc['gpus']} shared")
            bound = (f" (fill bound {r['fill_bound_vs_async']:.2f}x async)"
                     if "fill_bound_vs_async" in r else "")
            lines.append(f"| {where} | {r['mode']} | {r['samples_per_s']:.1f} | "
                         f"{r['vs_sync']:.2f}x{bound} | {r['paper'] or '-'} | "
                         f"{_pct(r['replayed_frac'])} | {r['staleness_max']} | {gpus} |")
    return "\n".join(lines)


def write_report(reports: list[dict[str, Any]], out_dir: Path, plots: bool = True,
                 pat: list[dict[str, Any]] | None = None,
                 modes: list[dict[str, Any]] | None = None) -> str:
    """Write ``report.md``, ``results.json`` and the plots; returns the printed text."""
    out_dir.mkdir(parents=True, exist_ok=True)
    images: list[Path] = []
    if plots:
        for rep in reports:
            images += plot_scenario(rep["scenario"]["name"], rep["results"], out_dir)
    head = ("# rlhfless simulation report\n\nOur policy vs two serverful verl baselines "
            "(static colocated pool, no prefix dedup, even split, billed for the whole run): "
            "verl-0.3 with its rollout defaults (eager, TP 2, half the memory for KV) and "
            "verl-tuned (CUDA graphs, 0.9 of memory, fastest TP). The bound is the best any "
            "scheduler could do given the update; the paper's figures are RLHFless's "
            "reported ones.\n\n" + headline_table(reports)
            + "\n\n" + baselines_table(reports))
    body = "\n\n".join(scenario_section(rep) for rep in reports)
    if pat:
        body += ("\n\n## PAT: adaptive TP in the generation tail\n\nverl-tuned at a static "
                 "TP, with and without PAT's mid-generation merges (reserved pool, so GPU-s "
                 "follow the step time). Merges only widen TP; when the widest TP is the "
                 "fastest at every live batch size, PAT's rule merges at its first consult "
                 "(the first completion), so from a narrow TP it approaches the fastest "
                 "static TP; it passes it only where a narrower TP is faster in the full "
                 "batch.\n\n"
                 + pat_table(pat))
    if modes:
        body += ("\n\n## Training modes vs sync\n\nThe same trace and policy; async modes "
                 "on the fastest split of the GPUs into a generation pool and a learner, sync "
                 "and replay on the scenario's own cluster (schedulers/sim/modes.py).\n\n"
                 + modes_table(modes))
    figs = "\n".join(f"![{p.stem}]({p.name})" for p in images)
    (out_dir / "report.md").write_text(f"{head}\n\n{body}\n\n{figs}\n")
    clean = [{k: v for k, v in rep.items() if k != "results"} for rep in reports]
    (out_dir / "results.json").write_text(json.dumps(clean, indent=1, default=float))
    if pat:
        (out_dir / "pat.json").write_text(json.dumps(pat, indent=1, default=float))
    if modes:
        (out_dir / "modes.json").write_text(json.dumps(modes, indent=1, default=float))
    return f"{head}\n\n{body}"
