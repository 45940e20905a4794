"""Hostile and careless data, through the real command line: every probe ends in one line
on stderr that names the problem and the fix, a non-zero exit, no traceback, and nothing
changed outside the run's own directory."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from rlhfless.pipeline.cli import main

RUN = "probe"


def tally_rows(n: int, start: int = 0) -> list[dict]:
    return [{"prompt_id": f"p{i}", "prompt": f"Count the items one by one, then give the "
             f"total.\nItems: {' '.join(['nut'] * (1 + i % 4))}\nAnswer:",
             "answer": str(1 + i % 4), "data_source": "tally"} for i in range(start, start + n)]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def snapshot(root: Path, skip: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` outside ``skip``: (size, mtime in ns)."""
    out = {}
    for directory, _, names in os.walk(root):
        for name in names:
            p = Path(directory) / name
            if skip not in p.parents:
                st = p.stat()
                out[str(p)] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture
def probe(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """``probe(*argv)`` runs ``rlhfless train`` with the quick tiny model in a run directory
    under ``tmp_path/runs`` and returns (exit code, stderr lines, stdout); it checks that
    nothing outside the run directory changed."""
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / RUN

    def run(*argv: str, command: str = "train") -> tuple[int, list[str], str]:
        before = snapshot(tmp_path, run_dir)
        base = ["--set", f"model={tiny_model_dir}", "--set", f"name={RUN}", "--set",
                "runs_dir=runs", "--no-progress"] if command == "train" else []
        capsys.readouterr()
        code = main([command, *argv, *base])
        out, err = capsys.readouterr()
        assert snapshot(tmp_path, run_dir) == before, "files outside the run directory changed"
        return code, [line for line in err.splitlines() if line.strip()], out

    return run


def strict(line: str) -> dict:
    """``json.loads`` that refuses NaN and Infinity."""
    def refuse(name: str):
        raise ValueError(f"{name} is not JSON")
    return json.loads(line, parse_constant=refuse)


def one_line(code: int, err: list[str], *fragments: str) -> str:
    assert code != 0, err
    assert len(err) == 1 and "Traceback" not in err[0], err
    for fragment in fragments:
        assert fragment in err[0], (fragment, err[0])
    return err[0]


def _parquet(path: Path, rows: list[dict], keep: int | None = None) -> Path:
    """``rows`` as a Parquet file; only the first ``keep`` of them (the columns stay)."""
    pq.write_table(pa.Table.from_pylist(rows).slice(0, keep), path)
    return path


def _cut(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


BAD_DATA = {  # name: (write the dataset into a folder, extra --set, what the line says)
    "empty jsonl": (lambda d: write_jsonl(d / "empty.jsonl", []), [],
                    ["empty.jsonl", "no prompts", "batch_prompts"]),
    "parquet without rows": (lambda d: _parquet(d / "none.parquet", tally_rows(1), keep=0), [],
                             ["none.parquet", "no prompts"]),
    "every row bad, skipped": (lambda d: write_jsonl(d / "bad.jsonl", [{"prompt": ""}] * 3),
                               ["on_bad_row=skip"],
                               ["bad.jsonl", "no prompts", "3 bad skipped"]),
    "not parquet": (lambda d: (d / "junk.parquet").write_bytes(b"PAR1" + bytes(300))
                    and d / "junk.parquet", [], ["junk.parquet", "cannot read as Parquet"]),
    "truncated parquet": (lambda d: _cut(_parquet(d / "cut.parquet", tally_rows(40))), [],
                          ["cut.parquet", "cannot read as Parquet"]),
    "bad row": (lambda d: write_jsonl(d / "row.jsonl", [*tally_rows(2), {"prompt": "  "},
                                                        *tally_rows(40, 2)]), [],
                ["row.jsonl:line 3", "'prompt' is empty", "on_bad_row = 'skip'"]),
    "not json": (lambda d: (d / "nj.jsonl").write_text(
        json.dumps(tally_rows(1)[0]) + "\n{oops\n") and d / "nj.jsonl", [],
        ["nj.jsonl:line 2", "on_bad_row = 'skip'"]),
    "duplicate ids": (lambda d: write_jsonl(d / "dup.jsonl", tally_rows(20) + tally_rows(1, 7)),
                      [], ["duplicate prompt_id 'p7'", "dup.jsonl:line 8", "dup.jsonl:line 21",
                           "unique"]),
}


@pytest.mark.parametrize("case", sorted(BAD_DATA))
def test_bad_data_is_one_line(probe, tmp_path, case):
    write, sets, fragments = BAD_DATA[case]
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    path = write(data_dir)
    extra = [x for item in sets for x in ("--set", item)]
    code, err, _ = probe("--set", f"dataset={path}", *extra)
    line = one_line(code, err, "rlhfless: config error: dataset", *fragments)
    assert len(line) < 600, line


def test_report_over_a_truncated_rollout_is_one_line(probe, finished_run, tmp_path):
    run = tmp_path / "runs" / RUN
    shutil.copytree(finished_run, run)
    _cut(run / "rollouts" / "iter-00002.parquet")
    code, err, _ = probe(str(run), command="report")
    one_line(code, err, "iter-00002.parquet", "cannot read as Parquet", "move it away")


def test_a_heldout_set_without_rows_is_one_line(probe, tmp_path):
    """Its accuracy was NaN, written into metrics.jsonl as a bare NaN."""
    (tmp_path / "empty.jsonl").write_text("\n\n")
    code, err, _ = probe("--set", f"heldout={tmp_path / 'empty.jsonl'}")
    one_line(code, err, "heldout", "empty.jsonl", "no prompts", "at least one")


def test_a_dataset_smaller_than_a_batch_is_one_line(probe, tmp_path):
    data = write_jsonl(tmp_path / "five.jsonl", tally_rows(5))
    code, err, _ = probe("--set", f"dataset={data}", "--set", "batch_prompts=8")
    one_line(code, err, "five.jsonl", "4 prompts (1 more held out for evaluation",
             "batch_prompts = 8", "at most 4", "give heldout")


def test_a_batch_across_the_epoch_boundary_trains(probe, tmp_path):
    """10 prompts, batch 8: iteration 2 crosses into epoch 2 (it crashed with "has 8
    samples, expected 4")."""
    data = write_jsonl(tmp_path / "ten.jsonl", tally_rows(10))
    code, err, _ = probe("--set", f"dataset={data}", "--set", "batch_prompts=8", "--set",
                      "n_samples=2", "--set", "iterations=2", "--set", "max_new_tokens=8",
                      "--set", "heldout_prompts=2", "--set", "eval_every=100",
                      "--set", "gen_workers=1", "--set", "train_threads=1")
    assert code == 0, err
    for it in (1, 2):
        table = pq.read_table(tmp_path / "runs" / RUN / "rollouts" / f"iter-{it:05d}.parquet")
        pairs = Counter(zip(table.column("prompt_id").to_pylist(),
                            table.column("sample_idx").to_pylist()))
        assert len(pairs) == 16 and set(pairs.values()) == {1}, (it, pairs)


@pytest.mark.slow  # two runs; test_checkpoint.py checks the same fall-back without a cluster
def test_resume_passes_over_a_checkpoint_overwritten_in_place(probe, tmp_path):
    """A weight chunk overwritten with as many bytes of NaN: resume used it (sizes matched)
    and trained on NaN weights from then on."""
    small = ["--set", "batch_prompts=4", "--set", "n_samples=2", "--set", "max_new_tokens=8",
             "--set", "heldout_prompts=2", "--set", "eval_every=100", "--set", "gen_workers=1",
             "--set", "train_threads=1", "--set", "checkpoint_every=1"]
    code, err, _ = probe(*small, "--set", "iterations=2")
    assert code == 0, err
    run = tmp_path / "runs" / RUN
    chunk = next((run / "checkpoints" / "iter-00002" / "trainer" / "model").rglob("c.*"))
    chunk.write_bytes(b"\xff" * chunk.stat().st_size)
    with (run / "metrics.jsonl").open("a") as f:  # and the writer was killed mid-line
        f.write('{"event": "iteration", "iteration": 3, "loss')
    code, err, out = probe("--resume", str(run), "--set", "iterations=3")
    assert code == 0, err
    said = [line for line in out.splitlines() if line.startswith("checkpoint skipped")]
    assert len(said) == 1 and "using iter-00001" in said[0] and "CRC32C" in said[0], out
    events = [strict(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    resumed = [e for e in events if e["event"] == "resume"]
    assert resumed[-1]["iteration"] == 1 and "iter-00002" in resumed[-1]["skipped"][0]
    last = [e for e in events if e["event"] == "iteration"][-1]
    assert last["iteration"] == 3 and math.isfinite(last["loss"])
    weights = load_file(run / "weights" / "v3.safetensors")
    assert all(torch.isfinite(t.float()).all() for t in weights.values())


def test_skips_and_bad_rewards_are_said_once_and_counted(probe, tmp_path):
    """Long prompts skipped and rewards of 1e300: one line each on the terminal with the
    count, counted in metrics.jsonl, and the batch keeps its advantages."""
    rows = tally_rows(12)
    for row in rows[:3]:
        row["prompt"] += " nut" * 60
    data = write_jsonl(tmp_path / "long.jsonl", rows)
    code, err, out = probe(
        "--set", f"dataset={data}", "--set", "max_prompt_tokens=60", "--set", "iterations=2",
        "--set", 'rewards={tally = "hostile_reward:overflowing"}', "--set", "batch_prompts=4",
        "--set", "n_samples=4", "--set", "max_new_tokens=12", "--set", "heldout_prompts=2",
        "--set", "eval_every=100", "--set", "gen_workers=1", "--set", "train_threads=1")
    assert code == 0, err
    skipped = [line for line in out.splitlines() if "over max_prompt_tokens skipped" in line]
    assert len(skipped) == 1 and "long.jsonl" in skipped[0] and "3 over" in skipped[0], out
    said = [line for line in out.splitlines() if "got reward_fallback" in line]
    assert len(said) == 1 and "reward out of range" in said[0], out
    run = tmp_path / "runs" / RUN
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e for e in events if e["event"] == "data"][0]["prompts_skipped_long"] == 3
    iterations = [e for e in events if e["event"] == "iteration"]
    assert sum(e["reward_out_of_range"] for e in iterations) > 0
    assert all(e["reward_out_of_range"] == e["reward_errors"] for e in iterations)
    for it in (1, 2):
        table = pq.read_table(run / "rollouts" / f"iter-{it:05d}.parquet")
        assert all(abs(r) <= 1 for r in table.column("reward").to_pylist())
        assert any(a != 0 for a in table.column("advantage").to_pylist()), it
