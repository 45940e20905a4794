"""``rlhfless config``, through the real command line: every key of ``Config`` with its
default and the meaning beside its field, the example configs (each loads, and the ones that
need no cluster of batch jobs run), and "did you mean" for an unknown key."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tomllib
from test_adapters import library

from rlhfless.pipeline.cli import main
from rlhfless.pipeline.config import Config, load_config
from rlhfless.pipeline.explain import examples, field_comments, key_meanings
from rlhfless.pipeline.train.inputs import check_inputs
from rlhfless.schedulers.scaling_policy import ScalingKnobs

EXAMPLES = ("gsm8k", "multi-turn", "reasoning-gym", "skyrl-gym", "slurm", "textarena", "tiny")
NEEDS = {"reasoning-gym": "reasoning_gym", "skyrl-gym": "skyrl_gym", "textarena": "textarena"}
SMALL = ["iterations=1", "batch_prompts=4", "n_samples=2", "max_new_tokens=4",
         "heldout_prompts=2", "gen_workers=1", "train_threads=1", "policy=static"]


def rlhfless(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlhfless.pipeline.cli", *argv],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


def test_config_lists_every_field_with_its_default_and_meaning(tmp_path):
    out = rlhfless("config")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    lines = out.stdout.splitlines()
    assert [line.split(" = ", 1)[0] for line in lines] == [
        f.name for f in dataclasses.fields(Config)]
    for line in lines:
        assert len(line.split("  # ", 1)[1].strip()) > 8, line
    listed = tmp_path / "defaults.toml"  # the listing is a TOML file of the defaults
    listed.write_text(out.stdout)
    assert tomllib.loads(out.stdout).keys() == Config().to_dict().keys()
    assert load_config(listed) == Config()
    assert "temperature = 1.0" in out.stdout  # a knob's meaning is the one beside its field
    assert key_meanings()["tau"] == field_comments(ScalingKnobs)["tau"]


@dataclass
class Commented:
    beside: int = 1  # its meaning
    spread: list[str] = field(  # said on the first line
        default_factory=list)
    # a comment above a field is not its meaning
    bare: int = 2
    after: int = 3
    # nor one below


def test_a_meaning_is_the_comment_beside_the_field():
    assert field_comments(Commented) == {"beside": "its meaning",
                                         "spread": "said on the first line"}


def test_an_unknown_key_says_which_is_close_in_one_line():
    out = rlhfless("train", "--set", "temprature=0.5")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert "unknown config key 'temprature'; did you mean 'temperature'?" in out.stderr
    assert "'rlhfless config' lists every key" in out.stderr
    assert "known keys" not in out.stderr and len(out.stderr) < 200


@pytest.mark.parametrize("name", EXAMPLES)
def test_each_example_prints_and_loads(name, tmp_path):
    assert sorted(examples()) == sorted(EXAMPLES)
    if name in NEEDS:  # an example of a library's adapter checks with the library
        library(NEEDS[name])
    out = rlhfless("config", "--example", name)
    assert out.returncode == 0, out.stderr
    path = tmp_path / f"{name}.toml"
    path.write_text(out.stdout)
    cfg = load_config(path)
    assert cfg.name == name and tomllib.loads(out.stdout)  # every key it sets is a real one
    if name != "gsm8k":  # gsm8k names a model and files the user supplies (run below)
        check_inputs(cfg)


def test_an_unknown_example_is_one_line_naming_them():
    out = rlhfless("config", "--example", "no-such-example")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "no such example" in out.stderr and "'gsm8k'" in out.stderr, out.stderr


def verl_rows(n: int, start: int = 0) -> list[dict]:
    """GSM8K-style rows as veRL's preprocessing writes them."""
    return [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "user", "content": f"Tom has {i} apples and buys 2 more. "
                         "How many apples does he have?"}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 2)},
             "extra_info": {"split": "train", "index": i}} for i in range(start, start + n)]


def run_example(name: str, tmp_path: Path, capsys, *sets: str) -> dict:
    config = tmp_path / f"{name}.toml"
    config.write_text(examples()[name])
    argv = ["train", str(config), "--no-progress"]
    for item in (*SMALL, f"runs_dir={tmp_path / 'runs'}", *sets):
        argv += ["--set", item]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out.splitlines()[-1])


@pytest.mark.slow  # real runs on a LocalCluster
@pytest.mark.parametrize("name", ["tiny", "multi-turn", "textarena"])
def test_the_embedded_examples_run(name, tiny_model_dir, tmp_path, capsys, monkeypatch):
    # the quick model stands in for the embedded one: its context is 128 positions, not 256
    if name in NEEDS:
        library(NEEDS[name])
    monkeypatch.chdir(tmp_path)
    summary = run_example(name, tmp_path, capsys, f"model={tiny_model_dir}",
                          "max_turn_tokens=16", "max_episode_tokens=64")
    assert Path(summary["run"]).name == name


@pytest.mark.slow  # a real run on a LocalCluster
def test_the_gsm8k_example_runs_on_verl_files(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """The example unchanged but for sizes: its model directory and veRL parquet files are
    where it says (the quick model, and rows in veRL's layout)."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_model_dir, tmp_path / "models" / "Qwen2.5-0.5B-Instruct")
    (tmp_path / "data" / "gsm8k").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(verl_rows(8)), "data/gsm8k/train.parquet")
    pq.write_table(pa.Table.from_pylist(verl_rows(3, 100)), "data/gsm8k/test.parquet")
    run_example("gsm8k", tmp_path, capsys)
    events = [json.loads(line) for line in
              (tmp_path / "runs" / "gsm8k" / "metrics.jsonl").read_text().splitlines()]
    assert [e["heldout_n"] for e in events if e["event"] == "eval"] == [2, 2]
    assert [e["prompts"] for e in events if e["event"] == "data"] == [8]
