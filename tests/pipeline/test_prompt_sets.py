"""The prompt sets of a run (pipeline/specs.py): a dataset given without ``heldout`` is
evaluated on a fixed split of its own prompts, kept out of training and said once, never on
the tiny task's."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhfless.pipeline.config import Config, ConfigError
from rlhfless.pipeline.specs import load_prompt_sets, split_heldout


def rows(n: int) -> list[dict]:
    return [{"prompt_id": f"mine-{i}", "prompt": f"What is {i} plus 1?\nAnswer:",
             "answer": str(i + 1), "data_source": "mine"} for i in range(n)]


def write(path, items):
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return path


def test_the_split_depends_on_the_ids_alone():
    table = pa.Table.from_pylist(rows(50))
    train, held = split_heldout(table, 7)
    ids = set(held.column("prompt_id").to_pylist())
    assert len(ids) == 7 and len(train) == 43
    assert ids.isdisjoint(train.column("prompt_id").to_pylist())
    order = list(range(50))
    random.Random(3).shuffle(order)
    _, held_shuffled = split_heldout(table.take(order), 7)
    assert set(held_shuffled.column("prompt_id").to_pylist()) == ids
    assert held.column("prompt_id").to_pylist() == sorted(ids, key=lambda s: int(s[5:]))
    _, more = split_heldout(table, 9)  # a larger share holds the smaller one
    assert ids < set(more.column("prompt_id").to_pylist())


def test_a_dataset_without_heldout_keeps_its_own_split_out_of_training(tiny_model_dir,
                                                                       tmp_path):
    data = write(tmp_path / "mine.jsonl", rows(60))
    said = []
    cfg = Config(model=str(tiny_model_dir), dataset=str(data), batch_prompts=8,
                 heldout_prompts=256)
    prompts, heldout, _ = load_prompt_sets(cfg, tiny_model_dir, log=said.append)
    train_ids = set(prompts.column("prompt_id").to_pylist())
    held_ids = set(heldout.column("prompt_id").to_pylist())
    assert len(held_ids) == 6 and len(train_ids) == 54  # 1 in 10
    assert train_ids.isdisjoint(held_ids) and train_ids | held_ids == {r["prompt_id"]
                                                                       for r in rows(60)}
    assert set(heldout.column("data_source").to_pylist()) == {"mine"}
    assert len(said) == 1 and said[0].startswith("heldout: 6 of the 60 prompts of dataset")
    assert "mine.jsonl" in said[0] and "set heldout" in said[0]
    capped = Config(model=str(tiny_model_dir), dataset=str(data), batch_prompts=8,
                    heldout_prompts=2)
    assert len(load_prompt_sets(capped, tiny_model_dir, log=said.append)[1]) == 2


def test_a_heldout_file_or_the_tiny_task_is_used_as_before(tiny_model_dir, tmp_path):
    data = write(tmp_path / "mine.jsonl", rows(20))
    given = write(tmp_path / "held.jsonl", rows(25)[20:])
    said = []
    cfg = Config(model=str(tiny_model_dir), dataset=str(data), heldout=str(given),
                 batch_prompts=8)
    prompts, heldout, _ = load_prompt_sets(cfg, tiny_model_dir, log=said.append)
    assert len(prompts) == 20 and heldout.column("prompt_id").to_pylist() == [
        f"mine-{i}" for i in range(20, 25)]
    tiny = Config(model=str(tiny_model_dir), batch_prompts=8, heldout_prompts=5)
    _, heldout, _ = load_prompt_sets(tiny, tiny_model_dir, log=said.append)
    assert set(heldout.column("data_source").to_pylist()) == {"tally"} and len(heldout) == 5
    assert said == []


def test_column_keys_apply_to_your_files_only(tiny_model_dir, tmp_path):
    """``prompt_key``/``answer_key`` read your dataset and heldout by their columns, and
    leave the tiny task's held-out prompts (which have ``prompt``) as they are."""
    mapped = [{"question": r["prompt"], "meta": {"truth": r["answer"]}, "prompt_id": r["prompt_id"]}
              for r in rows(30)]
    data = write(tmp_path / "q.jsonl", mapped[:20])
    held = write(tmp_path / "h.jsonl", mapped[20:])
    cfg = Config(model=str(tiny_model_dir), dataset=str(data), heldout=str(held),
                 batch_prompts=8, prompt_key="question", answer_key="meta.truth")
    prompts, heldout, _ = load_prompt_sets(cfg, tiny_model_dir, log=print)
    assert prompts.column("answer").to_pylist() == [str(i + 1) for i in range(20)]
    assert heldout.column("answer").to_pylist() == [str(i + 1) for i in range(20, 30)]
    only_data = Config(model=str(tiny_model_dir), dataset=str(data), batch_prompts=8,
                       prompt_key="question", answer_key="meta.truth")
    assert len(load_prompt_sets(only_data, tiny_model_dir, log=print)[1]) == 2  # own split
    tiny = Config(model=str(tiny_model_dir), batch_prompts=8, heldout_prompts=5,
                  prompt_key="question", answer_key="meta.truth")
    _, tiny_heldout, _ = load_prompt_sets(tiny, tiny_model_dir, log=print)
    assert len(tiny_heldout) == 5 and None not in tiny_heldout.column("answer").to_pylist()
    with pytest.raises(ConfigError, match="dataset: .*no 'question' field"):
        load_prompt_sets(Config(model=str(tiny_model_dir), dataset=str(write(
            tmp_path / "plain.jsonl", rows(20))), batch_prompts=8, prompt_key="question"),
            tiny_model_dir, log=print)
    with pytest.raises(ConfigError, match="prompt_key = '' names no column"):
        Config(prompt_key="")


@pytest.mark.slow  # a real run; the two tests above check the split without a cluster
def test_a_run_says_the_split_and_evaluates_on_it(tiny_model_dir, tmp_path, monkeypatch,
                                                 capsys):
    """It evaluated on the tiny task's 256 prompts and reported that as heldout_accuracy."""
    from rlhfless.pipeline.cli import main

    monkeypatch.chdir(tmp_path)
    write(tmp_path / "mine.jsonl", rows(40))
    code = main(["train", "--no-progress", "--set", f"model={tiny_model_dir}", "--set",
                 "dataset=mine.jsonl", "--set", "batch_prompts=36", "--set", "n_samples=2",
                 "--set", "iterations=1", "--set", "max_new_tokens=4", "--set",
                 "heldout_prompts=8", "--set", "gen_workers=1", "--set", "train_threads=1",
                 "--set", 'rewards={mine = "exact"}'])
    out, err = capsys.readouterr()
    assert code == 0, err
    said = [line for line in out.splitlines() if line.startswith("heldout:")]
    assert len(said) == 1 and "4 of the 40 prompts of dataset mine.jsonl" in said[0], out
    run = tmp_path / "runs" / "tiny"
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["heldout_n"] for e in evals] == [4, 4]
    trained = set(pq.read_table(run / "rollouts" / "iter-00001.parquet")
                  .column("prompt_id").to_pylist())
    held = set(split_heldout(pa.Table.from_pylist(rows(40)), 4)[1]
               .column("prompt_id").to_pylist())
    assert len(trained) == 36 and trained.isdisjoint(held)


def test_prompts_given_from_python_become_files_of_the_run(tiny_model_dir, tmp_path):
    """``train(cfg, dataset=obj)``'s first step: each object becomes a Parquet file of the run
    named by its rows, which the prompt sets then read like any file."""
    import datasets
    import pandas as pd

    from rlhfless.pipeline.config import ConfigError
    from rlhfless.pipeline.train.inputs import check_inputs, given_prompts, write_given_prompts

    cfg = Config(model=str(tiny_model_dir), runs_dir=str(tmp_path / "runs"), batch_prompts=8)
    frame = pd.DataFrame(rows(30))
    held = datasets.Dataset.from_list(rows(35)[30:])
    resolved, tables = given_prompts(cfg, dataset=frame, heldout=held)
    inputs = tmp_path / "runs" / "tiny" / "inputs"
    assert set(tables) == {"dataset", "heldout"}
    assert Path(resolved.dataset).parent == inputs and Path(resolved.heldout).parent == inputs
    with pytest.raises(ConfigError, match="dataset = .*no such file"):
        check_inputs(resolved)  # not yet written
    check_inputs(resolved, given=frozenset(tables))
    inputs.parent.mkdir(parents=True)  # the run directory, which train() has opened by now
    write_given_prompts(resolved, tables)
    assert sorted(p.name for p in inputs.iterdir()) == sorted(
        [Path(resolved.dataset).name, Path(resolved.heldout).name])  # no temporary left
    prompts, heldout, _ = load_prompt_sets(resolved, tiny_model_dir, log=print)
    assert prompts.column("prompt_id").to_pylist() == [f"mine-{i}" for i in range(30)]
    assert heldout.column("answer").to_pylist() == ["31", "32", "33", "34", "35"]
    same, _ = given_prompts(cfg, dataset=pd.DataFrame(rows(30)))
    other, _ = given_prompts(cfg, dataset=pd.DataFrame(rows(31)))
    assert same.dataset == resolved.dataset != other.dataset  # the name is the rows'
    with pytest.raises(ConfigError, match="dataset is given twice"):
        given_prompts(Config(dataset="mine.jsonl"), dataset=frame)
    with pytest.raises(ConfigError, match=r"train\(heldout=...\): cannot read prompts from a "
                                          "list"):
        given_prompts(cfg, heldout=rows(3))


@pytest.mark.slow
def test_train_takes_a_data_frame_and_resumes_only_with_the_same_rows(tiny_model_dir,
                                                                      tmp_path):
    import pandas as pd

    from rlhfless.pipeline.durable.recovery import ResumeError
    from rlhfless.pipeline.train.loop import train

    cfg = Config(model=str(tiny_model_dir), runs_dir=str(tmp_path / "runs"), batch_prompts=8,
                 n_samples=2, iterations=1, max_new_tokens=4, heldout_prompts=4,
                 gen_workers=1, train_threads=1, rewards={"mine": "exact"})
    run = train(cfg, progress=False, log=lambda *_: None, dataset=pd.DataFrame(rows(40)))
    saved = json.loads((run.path / "config.json").read_text())["dataset"]
    assert Path(saved).parent == run.path / "inputs"
    assert pq.read_table(saved).column("prompt_id").to_pylist() == [f"mine-{i}"
                                                                      for i in range(40)]
    trained = set(pq.read_table(run.path / "rollouts" / "iter-00001.parquet")
                  .column("prompt_id").to_pylist())
    assert len(trained) == 8 and trained <= {r["prompt_id"] for r in rows(40)}
    with pytest.raises(ResumeError, match="dataset"):
        train(cfg, progress=False, log=lambda *_: None, resume=True,
              dataset=pd.DataFrame(rows(41)))
    assert [p.name for p in (run.path / "inputs").iterdir()] == [Path(saved).name]
