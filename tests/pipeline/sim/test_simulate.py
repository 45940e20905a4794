"""``rlhfless simulate``: report directory, scenario files, plan mode, clear errors."""

from __future__ import annotations

import json

import pytest

from rlhfless.pipeline.cli import main
from rlhfless.pipeline.report.trace_events import read_trace
from rlhfless.pipeline.sim.simulate import ScenarioError, load_scenario

SCENARIO = """
name = "tiny-plan"
profile = "Qwen2.5-3B@L40S"
gpus = 4
[workload]
preset = "gsm8k"
dataset_prompts = 128
batch_prompts = 32
iterations = 3
[policy]
lambda_cost = 0.5
"""


def test_simulate_writes_report_and_prints_headline(tmp_path, capsys):
    out = tmp_path / "report"
    assert main(["simulate", "--quick", "--iterations", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    report = (out / "report.md").read_text()
    for row in ("rlhfuse-like", "+cut-and-migrate", "oracle", "verl-0.3", "verl-tuned",
                "+shared-prompt forward", "+forwards in the tail", "upper bound"):
        assert row in report, row
    results = json.loads((out / "results.json").read_text())
    assert [r["scenario"]["name"] for r in results] == ["paper-physical", "paper-simulated"]
    for r in results:
        check_headline(r, text)
        trace = read_trace(out / f"trace-{r['scenario']['name']}.json")  # our policy's run
        assert sum(e["name"] == "iteration" for e in trace) == 2
    pats = json.loads((out / "pat.json").read_text())
    assert "vs fastest static TP" in report
    assert all(r["gen_change_vs_fastest"] == pytest.approx(
        r["pat_gen_s"] / min(p["rows"], key=lambda x: x["static_step_s"])["static_gen_s"] - 1)
        for p in pats for r in p["rows"])
    assert "Training modes vs sync" in report
    modes = json.loads((out / "modes.json").read_text())
    assert [m["scenario"]["name"] for m in modes] == ["paper-physical", "paper-simulated",
                                                      "long-cot-modes"]
    assert all([r["mode"] for r in m["rows"]] == ["sync", "replay", "async", "async+replay"]
               for m in modes)
    for m in modes:  # each row's throughput and ratio from its own samples and seconds
        sync = m["rows"][0]
        for row in m["rows"]:
            assert row["samples_per_s"] == pytest.approx(row["samples"] / row["total_s"])
            assert row["vs_sync"] == pytest.approx(row["samples_per_s"] / sync["samples_per_s"])
            assert f"{row['vs_sync']:.2f}x" in report
        assert sync["staleness_max"] == 0 and m["rows"][2]["replayed_frac"] == 0
    pytest.importorskip("matplotlib")
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert len(pngs) == 6 and all((out / p).read_bytes()[:4] == b"\x89PNG" for p in pngs)


def check_headline(result: dict, printed: str) -> None:
    """A scenario's figures against their definitions: each row's speedup and GPU-s reduction
    follow from its own and verl-0.3's step and GPU seconds, the bound is below every row, the
    lambda found at the paper's speed reaches it, and the printed headline row says so."""
    rows = {row["label"]: row for row in result["table"]}
    base, tuned = rows["verl-0.3"], rows["verl-tuned"]
    for row in rows.values():
        assert row["speedup"] == pytest.approx(base["step_s"] / row["step_s"])
        assert row["gpu_s_reduction"] == pytest.approx(
            1 - row["gpu_s_per_iteration"] / base["gpu_s_per_iteration"])
        assert row["speedup_tuned"] == pytest.approx(tuned["step_s"] / row["step_s"])
    bound, paper = result["bound"], result["scenario"]["paper"]
    assert bound["step_s"] <= min(row["step_s"] for row in rows.values())
    assert bound["gpu_s_per_iteration"] <= min(row["gpu_s_per_iteration"]
                                               for row in rows.values())
    assert result["at_paper_speed"]["speedup"] >= paper["speedup"]
    ours, mechanisms = rows["rlhfless (ours)"], rows["+cut-and-migrate"]
    speedups = " / ".join(f"{x:.2f}x" for x in (ours["speedup"], mechanisms["speedup"],
                                                 bound["speedup"], paper["speedup"]))
    assert speedups in printed and f"-{100 * paper['reduction']:.1f}%" in printed


def test_scenario_file_with_sweeps_and_plan(tmp_path, capsys):
    path = tmp_path / "s.toml"
    path.write_text(SCENARIO)
    out = tmp_path / "r"
    assert main(["simulate", str(path), "--no-plots", "--out", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "Sweep of tau" in report and "Sweep of lambda_cost" in report
    assert main(["simulate", str(path), "--plan", "--deadline", "1e9", "--out", str(out)]) == 0
    assert "recommendation for deadline" in capsys.readouterr().out
    plan = json.loads((out / "plan-tiny-plan.json").read_text())
    best = plan["recommendation"]
    assert best["gpu_s_per_iteration"] == min(r["gpu_s_per_iteration"]
                                              for r in plan["candidates"])


def test_scenario_takes_the_policy_knobs_of_a_run_configuration(tmp_path):
    (tmp_path / "run.toml").write_text('policy = "elastic"\ntau = 0.6\newma_alpha = 0.5\n')
    path = tmp_path / "s.toml"
    path.write_text(SCENARIO.replace("[workload]", 'config = "run.toml"\n[workload]'))
    policy = load_scenario(path).policy
    assert (policy.tau, policy.ewma_alpha, policy.lambda_cost) == (0.6, 0.5, 0.5)
    assert policy.pat  # the mechanisms stay ours
    (tmp_path / "run.toml").write_text("tau = 2.0\n")
    with pytest.raises(ScenarioError, match=r"tau = 2.0; allowed: \(0, 1\]"):
        load_scenario(path)


def test_bad_scenario_is_one_clear_line(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text('gpus = 4\n[workload]\nbatch_promts = 3\n')
    assert main(["simulate", str(path), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown key(s) ['batch_promts']" in err and "\n" not in err
    path.write_text('profile = "nope"\n')
    with pytest.raises(ScenarioError, match="unknown profile 'nope'"):
        load_scenario(path)


def test_at_paper_speed_finds_the_cheapest_lambda_that_keeps_the_paper_speed():
    import dataclasses

    from rlhfless.pipeline.sim.simulate import Scenario, at_paper_speed, baselines
    from rlhfless.schedulers.profiles import get_profile
    from rlhfless.schedulers.sim.simulator import simulate
    from rlhfless.schedulers.sim.workloads import GSM8K, synthetic_trace

    work = dataclasses.replace(GSM8K, dataset_prompts=128, batch_prompts=32, iterations=3)
    sc = Scenario("t", get_profile("Qwen2.5-3B@L40S"), 4, work)
    trace = synthetic_trace(work)
    base = baselines(trace, sc)["verl-0.3"].summary()

    def speed(lam: float) -> float:
        run = simulate(trace, sc.profile, sc.cluster, sc.policy.replace(lambda_cost=lam))
        return base["step_s"] / run.summary()["step_s"]

    slow, fast = speed(0.0), speed(sc.policy.lambda_cost)
    assert fast > slow
    target = 0.5 * (slow + fast)
    point = at_paper_speed(trace, dataclasses.replace(sc, paper={"speedup": target}), base)
    assert point["speedup"] >= target and point["lambda_cost"] < sc.policy.lambda_cost
    assert point["speedup"] == pytest.approx(speed(point["lambda_cost"]))
    assert at_paper_speed(trace, dataclasses.replace(sc, paper={"speedup": fast * 1.01}), base) \
        is None
    assert at_paper_speed(trace, sc, base) is None  # no paper figure
