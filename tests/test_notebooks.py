"""The notebooks execute from a clean state (nbclient, a fresh kernel each), with small
settings injected after their ``parameters`` cell, in a scratch directory; every code cell
must run without error, and the notebooks are committed without outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat (notebooks extra) not installed")
nbclient = pytest.importorskip("nbclient", reason="nbclient (notebooks extra) not installed")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = ("quickstart", "elasticity", "simulation")


def execute(name: str, workdir: Path, until: str | None = None,
            **parameters) -> nbformat.NotebookNode:
    """Run ``notebooks/<name>.ipynb`` in ``workdir`` with ``parameters`` set right after its
    cell tagged ``parameters``, up to the markdown cell that starts with ``until`` (None:
    the whole notebook); returns the executed notebook."""
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    if until is not None:
        [end] = [i for i, c in enumerate(nb.cells)
                 if c.cell_type == "markdown" and c.source.startswith(until)]
        nb.cells = nb.cells[:end]
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{name}: exactly one cell must be tagged 'parameters'"
    injected = "\n".join(f"{k} = {v!r}" for k, v in parameters.items())
    nb.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(injected))
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=240,
                                     resources={"metadata": {"path": str(workdir)}})
    client.execute()
    return nb


def outputs_of(nb, kind: str) -> list:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if kind in o.get("data", {})]


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_committed_without_outputs(name):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, name


QUICK = dict(iterations=2, batch_prompts=6, n_samples=3, max_new_tokens=12, heldout_prompts=8)


def test_quickstart_trains_with_live_progress_and_shows_the_graph(tiny_model_dir, tmp_path):
    """Up to its agent section: the agent's run is a second cluster's (the slow test below;
    tests/pipeline/train/test_agents.py runs agents on a cluster in the quick suite)."""
    nb = execute("quickstart", tmp_path, until="## An agent", model=str(tiny_model_dir),
                 **QUICK)
    assert len(outputs_of(nb, "image/png")) >= 5  # graph, live plot, 4 figures of the run
    assert (tmp_path / "runs" / "quickstart" / "report" / "index.html").exists()
    metrics = (tmp_path / "runs" / "quickstart" / "metrics.jsonl").read_text()
    assert metrics.count('"event": "iteration"') == 2


@pytest.mark.slow
def test_quickstart_ends_with_an_agent_run(tiny_model_dir, tmp_path):
    nb = execute("quickstart", tmp_path, model=str(tiny_model_dir), agent_iterations=1,
                 **QUICK)
    # the agent run (the quick model plays tally-agent here): its iteration, agents' wait
    agent = (tmp_path / "runs" / "quickstart-agent" / "metrics.jsonl").read_text()
    assert agent.count('"event": "iteration"') == 1
    assert any("env_wait_share" in o["data"]["text/html"] for o in outputs_of(nb, "text/html"))


def test_elasticity_notebook_on_a_finished_elastic_run(finished_run, tmp_path):
    nb = execute("elasticity", tmp_path, run_path=str(finished_run))
    assert len(outputs_of(nb, "image/png")) == 3  # two timelines, worker-seconds
    tables = [o["data"]["text/html"] for o in outputs_of(nb, "text/html")]
    assert any("release" in t for t in tables) and any("worker·s" in t for t in tables)


def test_simulation_notebook_what_if_and_plan(tmp_path):
    nb = execute("simulation", tmp_path, iterations=2, deadline_s=1e9,
                 out_dir=str(tmp_path / "sim"))
    assert len(outputs_of(nb, "image/png")) >= 6  # policies, sweeps, 3 scenario plots, plan
    assert any("recommendation" in "".join(o["data"]["text/markdown"])
               for o in outputs_of(nb, "text/markdown"))
