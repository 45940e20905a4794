"""``rlhfless simulate``: what would a run cost, and how do the policies compare?

    rlhfless simulate [scenario.toml ...] [--out DIR] [--iterations N] [--quick]
    rlhfless simulate scenario.toml --plan (--deadline SECONDS | --budget GPU_S)

Every scenario also runs the training modes against sync (``sim_modes``: async, replay,
async+replay with our policy; ``modes.json``), and without a scenario file a long
chain-of-thought setting for the modes alone (``modes_scenarios``).

Without a scenario file the two settings of the RLHFless paper are simulated, its physical
testbed (GRPO, Qwen2.5-3B, GSM8K-like lengths, 16 L40S) and its simulated cluster
(Llama2-70B, 20 x 8 H100), and PAT's two (``run_pat``: static TP against PAT on long
chain-of-thought lengths, Llama-3.1-8B and Qwen3-14B on 8 H100). Every scenario runs two
verl baselines (``verl-0.3``: the paper's, with verl 0.3's rollout defaults;
``verl-tuned``: CUDA graphs, 0.9 of memory, the fastest TP), the RLHFuse-like and Oracle
baselines, our policy and its ablation chain on one trace, the upper bound of any scheduler
given the update (``sim_bounds``), plus sweeps of tau, lambda and the EWMA alpha; the report
directory gets ``report.md``, ``results.json``, ``pat.json`` and PNG plots (step time,
GPU-seconds, utilisation over time). ``--plan`` searches pool sizes and lambda for the
cheapest configuration that meets a per-iteration deadline, or the fastest one within a
per-iteration GPU-second budget.

A scenario file (TOML)::

    name = "my-run"
    profile = "Qwen2.5-7B@H100"        # built-in; or fit_run = "runs/<name>" to fit one
    gpus = 64
    train_gpus = 64                    # optional (default: gpus)
    [workload]                         # WorkloadConfig fields; preset = "gsm8k" | "reasoning"
    preset = "reasoning"
    batch_prompts = 512
    config = "run.toml"                # optional: a run's configuration; its elastic knobs
                                       # (tau, lambda_cost, ewma_alpha, ...) are the policy's
    [policy]                           # our elastic policy's knobs (PolicyConfig fields),
    lambda_cost = 0.5                  # over those of config
    [profile_overrides]                # any Profile field, e.g. gen_cold_start_s = 60
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from rlhfless.schedulers.profiles import Profile, get_profile
from rlhfless.schedulers.sim.bounds import generation_bound, iteration_bounds
from rlhfless.schedulers.sim.modes import simulate_modes
from rlhfless.schedulers.sim.profile_fit import profile_from_run
from rlhfless.schedulers.sim.sim_policy import (
    ELASTIC,
    ORACLE,
    RLHFUSE,
    VERL_03,
    VERL_TUNED,
    PolicyConfig,
    ablations,
)
from rlhfless.schedulers.sim.simulator import ClusterConfig, SimResult, simulate
from rlhfless.schedulers.sim.workloads import (
    GSM8K,
    LONG_COT,
    WORKLOADS,
    Trace,
    WorkloadConfig,
    synthetic_trace,
)

from ..config import load_config
from .report import OURS, write_report
from .trace import write_sim_trace

PAPER = {  # RLHFless headline figures vs verl (papers.md section 1.7)
    "paper-physical": {"speedup": 1.35, "reduction": 0.448},
    "paper-simulated": {"speedup": 1.23, "reduction": 0.387},
}
SWEEPS = {"tau": (0.5, 0.6, 0.7, 0.8, 0.9), "lambda_cost": (0.0, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0),
          "ewma_alpha": (0.25, 0.5, 0.75, 1.0)}
# which published verl step the generation/update split of a scenario is held against
# (verl_step_timings research notes; gen share = generation / step, testing excluded)
CALIBRATION = {"gsm8k": "verl GSM8K GRPO logs, 1024x5, max response 1024: generation 25 % "
                        "(Qwen2-7B, FSDP2), 34 % (Qwen2-7B GSM8K+MATH), 51 % (deepseek-7B)",
               "long-cot": "verl DAPO docs, Qwen2.5-Math-7B colocated sync: generation "
                           "30-50 % at 8-28K responses"}


class ScenarioError(ValueError):
    """A bad scenario file or value; the message names the key and what is allowed."""


@dataclass(frozen=True)
class Scenario:
    name: str
    profile: Profile
    gpus: int
    workload: WorkloadConfig
    train_gpus: int | None = None
    colocated: bool = True
    policy: PolicyConfig = ELASTIC
    paper: dict[str, float] = field(default_factory=dict)

    @property
    def calibration(self) -> str:
        return CALIBRATION.get(self.workload.name, "none (a custom workload)")

    @property
    def cluster(self) -> ClusterConfig:
        return ClusterConfig(self.gpus, self.train_gpus, self.colocated)

    def to_record(self) -> dict[str, Any]:
        return {"name": self.name, "profile": self.profile.to_record(), "gpus": self.gpus,
                "train_gpus": self.train_gpus, "colocated": self.colocated,
                "workload": self.workload.to_record(), "policy": self.policy.to_record(),
                "paper": self.paper, "calibration": self.calibration}


def paper_scenarios() -> list[Scenario]:
    return [
        Scenario("paper-physical", get_profile("Qwen2.5-3B@L40S"), 16, GSM8K,
                 paper=PAPER["paper-physical"]),
        Scenario("paper-simulated", get_profile("Llama2-70B@H100"), 160, GSM8K,
                 paper=PAPER["paper-simulated"]),
    ]


PAT_PAPER = {"gen_change": -0.346, "step_change": -0.272}  # PAT's headline vs static TP


def modes_scenarios() -> list[Scenario]:
    """The modes' own setting: long chain-of-thought (DeepScaleR-like lengths, 8K cap),
    Qwen3-14B on 32 H100, where generation weighs most."""
    return [Scenario("long-cot-modes", get_profile("Qwen3-14B@H100"), 32, LONG_COT)]


def run_modes(sc: Scenario) -> dict[str, Any]:
    """sync, replay, async and async+replay of ``sc`` with our policy (``sim_modes``)."""
    rows = simulate_modes(synthetic_trace(sc.workload), sc.profile, sc.cluster, sc.policy)
    return {"scenario": sc.to_record(), "rows": rows}


def pat_scenarios() -> list[Scenario]:
    """PAT's own setting: Llama-3.1-8B and Qwen3-14B on one 8-GPU node, DeepScaleR-like
    long chain-of-thought lengths."""
    return [Scenario(f"pat-{m}", get_profile(f"{m}@H100"), 8, LONG_COT, paper=PAT_PAPER)
            for m in ("Llama3.1-8B", "Qwen3-14B")]


def run_pat(sc: Scenario) -> dict[str, Any]:
    """Static TP (verl-tuned at every TP that fits) against the same with PAT: generation
    and step seconds, their change, PAT's generation against the fastest static TP, and the
    generation no TP schedule beats (the bound)."""
    trace = synthetic_trace(sc.workload)
    rows = []
    for tp in [t for t in sc.profile.feasible_tps(VERL_TUNED.engine) if t <= sc.gpus]:
        static = simulate(trace, sc.profile, sc.cluster, VERL_TUNED.replace(tp=tp)).summary()
        pat = simulate(trace, sc.profile, sc.cluster,
                       VERL_TUNED.replace(tp=tp, pat=True)).summary()
        # no TP schedule beats: the same sync and stage switch, then the longest alone
        prof = sc.profile.variant(VERL_TUNED.engine, tp)
        bound = prof.sync_s + prof.gen_wake_s + generation_bound(trace, prof)
        rows.append({"tp": tp, "static_gen_s": static["gen_s"], "pat_gen_s": pat["gen_s"],
                     "bound_gen_s": bound, "bound_gen_change": bound / static["gen_s"] - 1,
                     "static_step_s": static["step_s"], "pat_step_s": pat["step_s"],
                     "gen_change": pat["gen_s"] / static["gen_s"] - 1,
                     "step_change": pat["step_s"] / static["step_s"] - 1,
                     "reconfigurations": pat["reconfigurations"]})
    best = min(rows, key=lambda r: r["static_step_s"])
    for r in rows:  # against the static TP a tuned baseline would pick
        r["gen_change_vs_fastest"] = r["pat_gen_s"] / best["static_gen_s"] - 1
    return {"scenario": sc.to_record(), "rows": rows, "best_static_tp": best["tp"]}


def _fields(cls: type, values: dict[str, Any], where: str) -> dict[str, Any]:
    known = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(values) - known)
    if bad:
        raise ScenarioError(f"{where}: unknown key(s) {bad}; known: {sorted(known)}")
    return values


def load_scenario(path: str | Path) -> Scenario:
    """A ``Scenario`` from a TOML file (see the module docstring)."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError as err:
        raise ScenarioError(f"scenario file {path} does not exist") from err
    except tomllib.TOMLDecodeError as err:
        raise ScenarioError(f"scenario file {path}: {err}") from err
    top = {"name", "profile", "fit_run", "gpus", "train_gpus", "colocated", "workload",
           "config", "policy", "profile_overrides", "paper"}
    bad = sorted(set(raw) - top)
    if bad:
        raise ScenarioError(f"{path}: unknown key(s) {bad}; known: {sorted(top)}")
    try:
        if "fit_run" in raw:
            profile = profile_from_run(raw["fit_run"])
        else:
            profile = get_profile(raw.get("profile", "Qwen2.5-3B@L40S"))
        profile = profile.replace(**_fields(Profile, raw.get("profile_overrides", {}),
                                            f"{path} [profile_overrides]"))
        wl = dict(raw.get("workload", {}))
        preset = wl.pop("preset", "gsm8k")
        if preset not in WORKLOADS:
            raise ScenarioError(f"{path} [workload]: preset = {preset!r}; allowed: "
                                f"{sorted(WORKLOADS)}")
        workload = dataclasses.replace(WORKLOADS[preset], **_fields(
            WorkloadConfig, wl, f"{path} [workload]"))
        knobs = {}
        if "config" in raw:  # the run's own knobs, read as `rlhfless train` reads them
            run_cfg = load_config(path.parent / raw["config"])
            knobs = dataclasses.asdict(run_cfg.scaling_knobs())
        policy = ELASTIC.replace(**knobs | _fields(PolicyConfig, raw.get("policy", {}),
                                                   f"{path} [policy]"))
        gpus = raw.get("gpus", 16)
        if not isinstance(gpus, int) or gpus < 1:
            raise ScenarioError(f"{path}: gpus = {gpus!r}; allowed: an integer >= 1")
        return Scenario(raw.get("name", path.stem), profile, gpus, workload,
                        raw.get("train_gpus"), bool(raw.get("colocated", True)), policy,
                        raw.get("paper", {}))
    except (TypeError, ValueError, FileNotFoundError) as err:
        if isinstance(err, ScenarioError):
            raise
        raise ScenarioError(f"{path}: {err}") from err


def compare(results: dict[str, SimResult], baselines: dict[str, str]) -> list[dict[str, Any]]:
    """One row per policy: its summary plus, for each ``suffix -> baseline label``, the
    speedup and GPU-s reduction vs that baseline (``speedup<suffix>``,
    ``gpu_s_reduction<suffix>``)."""
    bases = {k: results[v].summary() for k, v in baselines.items()}
    rows = []
    for label, res in results.items():
        s = res.summary()
        s["label"] = label
        for suffix, base in bases.items():
            s[f"speedup{suffix}"] = base["step_s"] / s["step_s"]
            s[f"gpu_s_reduction{suffix}"] = 1.0 - s["gpu_s"] / base["gpu_s"]
        rows.append(s)
    return rows


def fastest_tp(trace: Trace, sc: Scenario, policy: PolicyConfig,
               tps: list[int]) -> tuple[PolicyConfig, SimResult]:
    """``policy`` at the TP (of ``tps``) with the shortest simulated step on ``trace``."""
    runs = [simulate(trace, sc.profile, sc.cluster, policy.replace(tp=t)) for t in tps]
    best = min(range(len(runs)), key=lambda i: runs[i].summary()["step_s"])
    return policy.replace(tp=tps[best]), runs[best]


def baselines(trace: Trace, sc: Scenario) -> dict[str, SimResult]:
    """The two verl baselines: ``verl-0.3`` at its default TP 2 (the fastest TP that fits
    at half the memory when TP 2 does not) and ``verl-tuned`` at its fastest TP."""
    tps = [t for t in sc.profile.feasible_tps(VERL_03.engine) if t <= sc.gpus]
    if not tps:
        raise ScenarioError(f"{sc.name}: {sc.profile.name} fits no TP <= {sc.gpus} GPUs at "
                            "verl 0.3's gpu_memory_utilization 0.5")
    _, old = fastest_tp(trace, sc, VERL_03, [2] if 2 in tps else tps)
    _, tuned = fastest_tp(trace, sc, VERL_TUNED, [
        t for t in sc.profile.feasible_tps(VERL_TUNED.engine) if t <= sc.gpus])
    return {VERL_03.name: old, VERL_TUNED.name: tuned}


SUFFIXES = {"": VERL_03.name, "_tuned": VERL_TUNED.name}


def at_paper_speed(trace: Trace, sc: Scenario, base: dict[str, float],
                   steps: int = 6) -> dict[str, float] | None:
    """Our policy at the paper's operating point on our speed/cost frontier: the smallest
    ``lambda_cost`` (bisected in ``[0, sc.policy.lambda_cost]``; speed rises with it) whose
    speedup over ``base`` (verl-0.3's summary) reaches the paper's, and the GPU-s reduction
    there. The paper reports one point of the trade-off without its lambda; this compares
    the two curves at equal speed. None when the paper gives no speed or the default lambda
    falls short of it."""
    if "speedup" not in sc.paper:
        return None

    def point(lam: float) -> dict[str, float]:
        s = simulate(trace, sc.profile, sc.cluster, sc.policy.replace(lambda_cost=lam)).summary()
        return {"lambda_cost": lam, "speedup": base["step_s"] / s["step_s"],
                "gpu_s_reduction": 1.0 - s["gpu_s"] / base["gpu_s"]}

    lo, hi = 0.0, sc.policy.lambda_cost
    best = point(hi)
    if best["speedup"] < sc.paper["speedup"]:
        return None
    for _ in range(steps):
        mid = point(0.5 * (lo + hi))
        if mid["speedup"] >= sc.paper["speedup"]:
            hi, best = mid["lambda_cost"], mid
        else:
            lo = mid["lambda_cost"]
    return best


def run_scenario(sc: Scenario, sweeps: bool = True) -> dict[str, Any]:
    """Both verl baselines, every other baseline, ablation and sweep of ``sc`` on one trace;
    JSON-able rows plus the ``SimResult``s of the baselines and ours (for plots)."""
    trace = synthetic_trace(sc.workload)
    ours = sc.policy.replace(name=OURS)
    results = baselines(trace, sc)
    done: dict[tuple, SimResult] = {}  # one simulation per distinct configuration
    for p in (ours, RLHFUSE, ORACLE.replace(**{k: v for k, v in sc.policy.to_record().items()
                                                if k not in ("name", "oracle")}), *ablations()):
        key = tuple(sorted((k, str(v)) for k, v in p.to_record().items() if k != "name"))
        if key not in done:
            done[key] = simulate(trace, sc.profile, sc.cluster, p)
        results[p.name] = done[key]
    tps = {k: results[k].profile.tp for k in SUFFIXES.values()}
    out: dict[str, Any] = {"scenario": sc.to_record(), "baseline_tp": tps,
                           "table": compare(results, SUFFIXES), "sweeps": {}}
    prof, b0 = results[ours.name].profile, trace.batches[0]
    bound = iteration_bounds(trace, prof, sc.train_gpus or sc.gpus, prof.batch_cap(
        float(b0.prompt_tokens.mean() + b0.lengths.mean())))
    for suffix, label in SUFFIXES.items():
        base = results[label].summary()
        bound[f"speedup{suffix}"] = base["step_s"] / bound["step_s"]
        bound[f"gpu_s_reduction{suffix}"] = 1.0 - bound["gpu_s_per_iteration"] / base[
            "gpu_s_per_iteration"]
    out["bound"] = bound
    out["at_paper_speed"] = at_paper_speed(trace, sc, results[VERL_03.name].summary())
    if sweeps:
        for key, values in SWEEPS.items():
            runs = {f"{key}={v}": simulate(trace, sc.profile, sc.cluster,
                                           ours.replace(**{key: v})) for v in values}
            out["sweeps"][key] = compare({**{k: results[k] for k in SUFFIXES.values()},
                                          **runs}, SUFFIXES)[2:]
    out["results"] = {k: results[k] for k in (*SUFFIXES.values(), ours.name)}
    return out


def plan(sc: Scenario, deadline_s: float | None = None, budget_gpu_s: float | None = None,
         pool_sizes: list[int] | None = None,
         lambdas: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)) -> dict[str, Any]:
    """Search pool sizes (GPUs) and lambda with our policy. With ``deadline_s`` (mean step
    seconds) pick the lowest GPU-s per iteration that meets it; with ``budget_gpu_s`` (per
    iteration) the fastest within it. Returns the candidates and the recommendation."""
    if (deadline_s is None) == (budget_gpu_s is None):
        raise ScenarioError("plan: give exactly one of --deadline or --budget")
    trace = synthetic_trace(sc.workload)
    tp = sc.profile.tp
    if pool_sizes is None:
        pool_sizes = sorted({max(tp, int(sc.gpus * f) // tp * tp)
                             for f in (0.25, 0.5, 0.75, 1.0, 1.5, 2.0)})
    rows = []
    for gpus in pool_sizes:
        cluster = ClusterConfig(gpus, sc.train_gpus, sc.colocated)
        for lam in lambdas:
            s = simulate(trace, sc.profile, cluster, sc.policy.replace(lambda_cost=lam)).summary()
            rows.append({"gpus": gpus, "lambda_cost": lam, "step_s": s["step_s"],
                         "gpu_s_per_iteration": s["gpu_s_per_iteration"],
                         "cost_usd_per_iteration": s["cost_usd"] / s["iterations"]})
    if deadline_s is not None:
        ok = [r for r in rows if r["step_s"] <= deadline_s]
        best = min(ok, key=lambda r: (r["gpu_s_per_iteration"], r["step_s"])) if ok else None
    else:
        ok = [r for r in rows if r["gpu_s_per_iteration"] <= budget_gpu_s]
        best = min(ok, key=lambda r: (r["step_s"], r["gpu_s_per_iteration"])) if ok else None
    return {"scenario": sc.name, "deadline_s": deadline_s, "budget_gpu_s": budget_gpu_s,
            "candidates": rows, "recommendation": best}


def plan_table(result: dict[str, Any]) -> str:
    lines = ["| GPUs | lambda | step s | GPU-s / iteration | $ / iteration |",
             "|---:|---:|---:|---:|---:|"]
    for r in result["candidates"]:
        lines.append(f"| {r['gpus']} | {r['lambda_cost']:.2f} | {r['step_s']:.1f} | "
                     f"{r['gpu_s_per_iteration']:.0f} | {r['cost_usd_per_iteration']:.3f} |")
    best = result["recommendation"]
    goal = (f"deadline {result['deadline_s']} s/iteration" if result["deadline_s"] is not None
            else f"budget {result['budget_gpu_s']} GPU-s/iteration")
    lines.append("")
    lines.append(f"recommendation for {goal}: " + (
        f"{best['gpus']} GPUs, lambda {best['lambda_cost']:.2f} (step {best['step_s']:.1f} s, "
        f"{best['gpu_s_per_iteration']:.0f} GPU-s/iteration)" if best
        else "none of the candidates meets it; widen the pool sizes or relax the goal"))
    return "\n".join(lines)


def main_simulate(scenarios: list[str], out: str, iterations: int | None = None,
                  quick: bool = False, plots: bool = True, plan_mode: bool = False,
                  plan_deadline: float | None = None, plan_budget: float | None = None) -> int:
    """Entry point of ``rlhfless simulate`` (argument parsing lives in ``cli.py``)."""
    scs = [load_scenario(p) for p in scenarios] if scenarios else paper_scenarios()
    pat_scs = [] if scenarios else pat_scenarios()
    mode_scs = scs + ([] if scenarios else modes_scenarios())
    if iterations is not None:
        scs, pat_scs, mode_scs = ([dataclasses.replace(s, workload=dataclasses.replace(
            s.workload, iterations=iterations)) for s in group]
            for group in (scs, pat_scs, mode_scs))
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if plan_mode:
        for sc in scs:
            result = plan(sc, plan_deadline, plan_budget)
            (out_dir / f"plan-{sc.name}.json").write_text(json.dumps(result, indent=1))
            print(f"## plan: {sc.name}\n\n{plan_table(result)}\n")
        return 0
    reports = [run_scenario(sc, sweeps=not quick) for sc in scs]
    for report in reports:  # our policy's run, in a real run's trace format
        name = report["scenario"]["name"]
        write_sim_trace(out_dir / f"trace-{name}.json", report["results"][OURS])
    pats = [run_pat(sc) for sc in pat_scs]
    modes = [run_modes(sc) for sc in mode_scs]
    text = write_report(reports, out_dir, plots=plots, pat=pats, modes=modes)
    print(text)
    print(f"\nreport written to {out_dir / 'report.md'}")
    return 0


def run_from_args(args: Any) -> int:
    """Run ``rlhfless simulate`` from parsed arguments; errors are one line on stderr."""
    try:
        return main_simulate(args.scenario, args.out, args.iterations, args.quick,
                             not args.no_plots, args.plan, args.deadline, args.budget)
    except (ScenarioError, RuntimeError) as err:
        print(f"rlhfless simulate: {err}", file=sys.stderr)
        return 2
