"""The simulator's trace: a real run's format, its iterations, phases and workers' lives."""

from __future__ import annotations

from collections import defaultdict

from rlhfless.pipeline.report.trace_events import DRIVER, US, pid_of, read_trace
from rlhfless.pipeline.sim.trace import write_sim_trace
from rlhfless.schedulers.profiles import get_profile
from rlhfless.schedulers.sim.sim_policy import ELASTIC
from rlhfless.schedulers.sim.simulator import ClusterConfig, simulate
from rlhfless.schedulers.sim.workloads import WorkloadConfig, synthetic_trace


def test_a_simulated_run_reads_back_as_a_trace_of_its_iterations_and_workers(tmp_path):
    trace = synthetic_trace(WorkloadConfig(dataset_prompts=64, batch_prompts=32, n_samples=4,
                                           iterations=3, max_response_tokens=512))
    result = simulate(trace, get_profile("Qwen2.5-3B@L40S"), ClusterConfig(4), ELASTIC)
    events = read_trace(write_sim_trace(tmp_path / "trace.json", result))
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["pid"] in names for e in spans)  # every span on a named track
    driver = [e for e in spans if e["pid"] == pid_of(DRIVER)]
    iterations = {e["args"]["iteration"]: e for e in driver if e["name"] == "iteration"}
    assert sorted(iterations) == [it.iteration for it in result.iterations]
    for it in result.iterations:
        box = iterations[it.iteration]
        assert box["dur"] / US == it.update_end - it.t_start
        for phase in (e for e in driver if e["name"] != "iteration"
                      and e["args"]["iteration"] == it.iteration):  # inside its iteration
            assert box["ts"] <= phase["ts"] and phase["ts"] + phase["dur"] <= box["ts"] + box[
                "dur"] + 1e-3
        assert {e["name"] for e in driver if e["args"]["iteration"] == it.iteration} >= {
            "iteration", "generate", "update"}
    # one track per worker the ledger saw; its lives billed as the ledger bills them
    lives = defaultdict(float)
    for e in spans:
        if e["pid"] != pid_of(DRIVER):
            lives[names[e["pid"]]] += e["dur"] / US
    for pool in ("gen", "train"):
        billed = result.ledger.worker_seconds(pool, until=result.t_end)
        traced = sum(s for name, s in lives.items() if name.startswith(pool))
        assert abs(traced - billed) <= 1e-6 * max(billed, 1.0), pool
