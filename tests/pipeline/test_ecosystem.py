"""Runs from configuration alone with the libraries users already have, and the checks that
refuse a bad environment, reward or budget before any worker starts.

* ``dataset = "reasoning-gym:basic_arithmetic"``: a real run on a LocalCluster; every reward
  in its rollouts equals reasoning-gym's own ``score_answer`` of the same text.
* ``environment = "skyrl-gym:gsm8k_multi_turn"``: a real run; every episode's per-turn
  rewards equal the library's own environment stepped with the same turns.
* ``environment = "gymnasium:gym_envs:rlhfless-test/Guess-v0"`` with ``[environments]``
  routing one ``data_source`` elsewhere: a real run; every game episode replays in the game,
  seeded by its row, to the same per-turn rewards, and the other source's rows played in
  their own environment.
* ``environment = "openenv:openenv_envs:GuessEnvironment"``: a real run; every episode
  replays in the OpenEnv class, seeded by its row, to the same per-turn rewards.
* ``environment = "textarena:2048-v0"`` with ``env_prompts`` and no dataset: a real run;
  every prompt is the game's first observation of the row's seed, every reward TextArena's
  own score of the same turns in the game of that seed.
* One line and exit 2, nothing written, no cluster: ``env_prompts`` without an environment,
  beside a held-out file, or with an environment whose reset makes no prompt;
  ``tiny_context`` for a model the tiny builder did not make; an environment module that
  does not import, a class that is not an environment, a skyrl-gym class given by module path,
  ``env_kwargs`` the class does not take, prompt + ``max_new_tokens`` over the context.
* A batch in which every episode fails stops the run with the environment's own error.

A library that is not installed skips its test, unless ``RLHFLESS_REQUIRE_ECOSYSTEM=1``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_adapters import library, turns_of
from test_hostile_inputs import one_line_error, snapshot
from transformers import AutoTokenizer

from rlhfless.pipeline.config import Config
from rlhfless.pipeline.train.loop import train

SMALL = dict(iterations=1, batch_prompts=4, n_samples=2, heldout_prompts=4, eval_every=1,
             gen_workers=1, train_threads=1, policy="static", keep_alive_s=0.0)


def rollouts(run_path) -> list[dict]:
    return pq.read_table(run_path / "rollouts" / "iter-00001.parquet").to_pylist()


def test_reasoning_gym_run_from_config_alone(tiny_model_dir, tmp_path):
    rg = library("reasoning_gym")
    cfg = Config(model=str(tiny_model_dir), runs_dir=str(tmp_path), name="rg",
                 dataset="reasoning-gym:basic_arithmetic",
                 dataset_kwargs={"size": 40, "seed": 5}, max_new_tokens=12,
                 require_answers=True, **SMALL)
    said: list[str] = []
    run = train(cfg, progress=False, log=said.append)
    assert any("held out for evaluation" in s or "heldout:" in s for s in said), said
    entries = list(rg.create_dataset("basic_arithmetic", size=40, seed=5))
    score_answer = rg.get_score_answer_fn("basic_arithmetic")
    rows = rollouts(run.path)
    assert len(rows) == cfg.batch_prompts * cfg.n_samples
    for row in rows:
        entry = entries[int(row["prompt_id"].rsplit(":", 1)[1])]
        assert row["answer"] == entry["answer"]
        assert row["reward_error"] is None
        assert row["reward"] == score_answer(row["response_text"], entry)


@pytest.mark.slow  # test_adapters.py runs its episodes through the rollout loop, quick
def test_skyrl_gym_run_from_config_alone(tiny_model_dir, tmp_path):
    skyrl = library("skyrl_gym")
    cfg = Config(model=str(tiny_model_dir), runs_dir=str(tmp_path), name="skyrl",
                 environment="skyrl-gym:gsm8k_multi_turn", max_turns=2, max_turn_tokens=12,
                 max_episode_tokens=100, max_prompt_tokens=24, step_cut_turns=True,
                 **SMALL)
    run = train(cfg, progress=False, log=lambda *_: None)
    rows = rollouts(run.path)
    assert len(rows) == cfg.batch_prompts * cfg.n_samples
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    stepped = 0
    for row in rows:
        assert row["env_error"] is None, row["env_error"]
        own = skyrl.make("gsm8k_multi_turn", env_config={},
                         extras={"reward_spec": {"ground_truth": row["answer"]},
                                 "extra_info": {}})
        turns = turns_of(row, tok)[:len(row["turn_rewards"])]
        want = [own.step(t)["reward"] for t in turns]
        assert row["turn_rewards"] == want
        assert row["reward"] == sum(want)
        stepped += len(want)
    assert stepped >= len(rows)  # every episode's turns reached the environment


@pytest.mark.slow
def test_an_environment_per_data_source_from_config_alone(tiny_model_dir, tmp_path):
    """``environment = "gymnasium:..."`` for every row, but ``[environments]`` gives the
    "chat" source a scripted one with its own ``env_kwargs``: one batch plays both."""
    library("gymnasium")
    import gym_envs

    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Round {i}.\n", "answer": "0", "seed": i,
                                        "data_source": ("guess", "chat")[i % 2]}) + "\n"
                            for i in range(12)))
    cfg = Config(model=str(tiny_model_dir), runs_dir=str(tmp_path), name="mixed",
                 dataset=str(data), max_turns=3, max_turn_tokens=8, max_episode_tokens=80,
                 step_cut_turns=True, environment="gymnasium:gym_envs:rlhfless-test/Guess-v0",
                 environments={"chat": {"environment": "episode_envs:Scripted",
                                        "env_kwargs": {"turns": 2}}},
                 **SMALL | {"batch_prompts": 11})  # all 11 training prompts: both sources
    run = train(cfg, progress=False, log=lambda *_: None)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    sources = set()
    for row in rollouts(run.path):
        assert row["env_error"] is None, row["env_error"]
        sources.add(row["data_source"])
        if row["data_source"] == "chat":
            assert row["turn_rewards"] == [0.25, 0.25]  # Scripted(turns=2)
            continue
        own = gym_envs.Guess()
        own.reset(seed=int(row["prompt_id"].rsplit(":", 1)[1]))
        turns = turns_of(row, tok)[:len(row["turn_rewards"])]
        assert row["turn_rewards"] == [gym_envs.guess_reward(t, own.target) for t in turns]
        assert row["reward"] == sum(row["turn_rewards"])
    assert sources == {"guess", "chat"}


@pytest.mark.slow  # test_adapters.py replays its episodes in the library, quick
def test_an_openenv_environment_runs_from_config_alone(tiny_model_dir, tmp_path):
    """``environment = "openenv:..."``: an OpenEnv ``Environment`` class run in process;
    every episode replays in the library's class, seeded by its row, to the same rewards."""
    library("openenv")
    import openenv_envs

    data = tmp_path / "guess.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Round {i}.\n", "answer": "0", "seed": i})
                            + "\n" for i in range(10)))
    cfg = Config(model=str(tiny_model_dir), runs_dir=str(tmp_path), name="openenv",
                 dataset=str(data), environment="openenv:openenv_envs:GuessEnvironment",
                 env_kwargs={"max_steps": 2}, max_turns=3, max_turn_tokens=8,
                 max_episode_tokens=80, step_cut_turns=True, **SMALL)
    run = train(cfg, progress=False, log=lambda *_: None)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = rollouts(run.path)
    assert len(rows) == cfg.batch_prompts * cfg.n_samples
    for row in rows:
        assert row["env_error"] is None, row["env_error"]
        own = openenv_envs.GuessEnvironment(max_steps=2)
        own.reset(seed=int(row["prompt_id"].rsplit(":", 1)[1]))
        turns = turns_of(row, tok)[:len(row["turn_rewards"])]
        assert 1 <= len(turns) <= 2  # the environment's own max_steps ends it
        assert row["turn_rewards"] == [openenv_envs.guess_reward(t, own.target) for t in turns]
        assert row["reward"] == sum(row["turn_rewards"])


def test_a_textarena_game_makes_its_own_prompts_from_config_alone(tiny_model_dir, tmp_path):
    """No dataset: ``env_prompts`` draws each prompt from 2048-v0's reset under its seed, and
    the tiny model, without ``tiny_context``, runs at a context that holds it (the game's
    board is ~370 tokens). Each prompt is its seed's first observation through the chat
    template, and each episode's reward is what TextArena scores for the same turns,
    replayed with that seed."""
    ta = library("textarena")
    cfg = Config(model=str(tiny_model_dir), runs_dir=str(tmp_path), name="game",
                 environment="textarena:2048-v0", env_prompts=4,
                 max_prompt_tokens=512, max_turns=2, max_turn_tokens=8,
                 max_episode_tokens=256, step_cut_turns=True, **SMALL | {"batch_prompts": 2})
    said: list[str] = []
    run = train(cfg, progress=False, log=said.append)
    assert ("prompts: 4 first observations of textarena:2048-v0 (seeds 0-3, env_prompts); "
            "heldout: 4 more (seeds from 1000000)") in said, said
    grown = [line for line in said if line.startswith("the tiny model runs at a context of")]
    need = int(grown[0].rsplit(" is ", 1)[1])  # the longest prompt + max_episode_tokens
    positions = int(grown[0].split()[8])
    assert positions // 2 < need <= positions  # the smallest power of two that holds it
    built = tiny_model_dir.parent / f"{tiny_model_dir.name}-ctx{positions}"
    assert json.loads((built / "config.json").read_text())["max_position_embeddings"] \
        == positions
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = rollouts(run.path)
    assert len(rows) == cfg.batch_prompts * cfg.n_samples
    for row in rows:
        assert row["env_error"] is None, row["env_error"]
        seed = json.loads(row["record"])["seed"]
        assert row["prompt_id"] == f"textarena:2048-v0:{seed}" and 0 <= seed < 4
        own = ta.make("2048-v0")
        own.reset(num_players=1, seed=seed)
        first = tok.apply_chat_template([{"role": "user", "content": own.get_observation()[1]}],
                                        tokenize=False, add_generation_prompt=True)
        assert row["prompt_ids"] == tok(first, add_special_tokens=False)["input_ids"]
        done = False
        for turn in turns_of(row, tok)[:len(row["turn_rewards"])]:
            done, _ = own.step(turn)
        rewards, _ = own.close()  # None: the game set no score before max_turns cut it
        assert row["reward"] == (rewards[0] if rewards else 0.0)
        assert done == (row["finish_reason"] == "stop")
    assert any(row["reward"] != 0 for row in rows)  # the game's score reached the trainer


@pytest.fixture
def workdir(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hostile_env.py").write_text(
        (Path(__file__).parent / "hostile_env.py").read_text())
    (tmp_path / "hf_model").mkdir()  # a model directory the tiny builder did not make
    (tmp_path / "hf_model" / "config.json").write_text("{}")
    return tmp_path


def train_argv(*sets: str, model=None) -> list[str]:
    argv = ["train", "--set", "name='x'", "--set", "iterations=1", "--set", "batch_prompts=4",
            "--set", "n_samples=2", "--set", "heldout_prompts=4", "--set", "gen_workers=1"]
    if model is not None:
        argv += ["--set", f"model={json.dumps(str(model))}"]
    for item in sets:
        argv += ["--set", item]
    return argv


@pytest.mark.parametrize(("sets", "says"), [
    (["environment='nosuch_mod:Env'"],
     "environment = 'nosuch_mod:Env' cannot be used: ModuleNotFoundError"),
    (["environment='hostile_env:NotAnEnvironment'"], "has no reset and no step method"),
    (["environment='skyrl_gym.envs.gsm8k.env:GSM8kEnv'"], "name it 'skyrl-gym:<id>'"),
    (["environment='skyrl-gym:nosuch'"], "skyrl-gym has no environment 'nosuch'"),
    (["environment='textarena:NoGame-v0'"], "textarena has no game 'NoGame-v0'"),
    (["environment='gymnasium:nosuch-v0'"], "gymnasium has no environment 'nosuch-v0'"),
    (["environment='tally-tool'", "env_kwargs={colour='red'}"],
     "cannot be built with env_kwargs = {'colour': 'red'}: TypeError"),
    (["environment='textarena:GuessTheNumber-v0'", "env_kwargs={max_number='x', colour=1}"],
     "cannot be built with env_kwargs = {'max_number': 'x', 'colour': 1}: TypeError"),
    (["dataset='reasoning-gym:nosuch'"], "reasoning-gym has no task 'nosuch'"),
    (["rewards={tally='nosuch_mod:fn'}"], "does not import (ModuleNotFoundError"),
    (["environments={tally='nosuch_mod:Env'}"],
     "environments.tally = 'nosuch_mod:Env' cannot be used: ModuleNotFoundError"),
    (["environments={tally={environment='tally-tool', env_kwargs={colour=1}}}"],
     "environments.tally = 'tally-tool' cannot be built with env_kwargs = {'colour': 1}"),
    (["environments={tally=3}"], "environments.tally = 3: give an environment name"),
    (["env_prompts=8"], "env_prompts = 8 needs environment = '<library>:<id>'"),
    (["env_prompts=8", "environment='tally-tool'", "heldout='h.jsonl'"],
     "env_prompts = 8 draws the prompts from environment's reset: remove heldout"),
    (["env_prompts=8", "environment='tally-tool'"],
     "'tally-tool': ValueError: environment 'tally-tool' gave no first observation for seed 0"),
    (["tiny_context=1024", "model='hf_model'"],
     "tiny_context = 1024 is for the embedded tiny model"),
])
def test_bad_environment_or_reward_is_refused_before_anything_starts(workdir, capsys, sets,
                                                                     says):
    if any("skyrl" in s for s in sets):
        library("skyrl_gym")
    if any("textarena" in s for s in sets):
        library("textarena")
    if any("reasoning-gym" in s for s in sets):
        library("reasoning_gym")
    before = snapshot(workdir)
    err = one_line_error(capsys, train_argv(*sets))
    assert says in err, err
    assert snapshot(workdir) == before  # no run directory, nothing written


def test_prompt_and_budget_over_the_context_is_refused_before_the_cluster(workdir, capsys,
                                                                          tiny_model_dir):
    err = one_line_error(capsys, train_argv("max_new_tokens=200", "max_prompt_tokens=100",
                                            "tiny_context=128", model=tiny_model_dir))
    assert "+ max_new_tokens = 200" in err and "over the model's context of 128" in err, err
    assert "prompt '" in err  # the worst prompt is named
    need = int(err.split(" is ")[2].split(",")[0])
    assert f"tiny_context = {1 << (need - 1).bit_length()} runs the embedded model" in err
    assert not list((workdir / "runs" / "x").glob("rollouts/*"))  # nothing generated


def test_a_game_no_model_context_holds_is_refused_naming_its_need(workdir, capsys,
                                                                  tiny_model_dir):
    """A model the tiny builder did not make (no recipe.json), with its 128 positions: the
    game's first observation does not fit, and the line names the game and its need."""
    library("textarena")
    model = workdir / "small_model"
    shutil.copytree(tiny_model_dir, model, ignore=shutil.ignore_patterns("recipe.json"))
    err = one_line_error(capsys, train_argv(
        "environment='textarena:GuessTheNumber-v0'", "env_prompts=4", "max_prompt_tokens=512",
        "max_turns=2", "max_turn_tokens=8", "max_episode_tokens=64", model=model))
    found = re.search(r"environment 'textarena:GuessTheNumber-v0': its first observation, "
                      r"prompt 'textarena:GuessTheNumber-v0:\d+' is (\d+) tokens, \+ "
                      r"max_episode_tokens = 64 is (\d+), over the model's context of 128 "
                      r"tokens; give a model whose context holds (\d+) tokens", err)
    assert found, err
    assert int(found[1]) + 64 == int(found[2]) == int(found[3])
    assert not list((workdir / "runs" / "x").glob("rollouts/*"))  # nothing generated


def test_a_data_source_without_an_environment_is_refused_before_the_cluster(workdir, capsys,
                                                                           tiny_model_dir):
    err = one_line_error(capsys, train_argv("environments={other='tally-tool'}",
                                            "max_episode_tokens=64", model=tiny_model_dir))
    assert "data_source 'tally' has no environment" in err and "other have one" in err, err
    assert not list((workdir / "runs" / "x").glob("rollouts/*"))  # nothing generated


def test_every_episode_failing_stops_the_run_with_the_environment_error(workdir, capsys,
                                                                        tiny_model_dir):
    err = one_line_error(capsys, [*train_argv("environment='hostile_env:NeedsColour'",
                                              "env_kwargs={colour='blue'}", "max_turn_tokens=8",
                                              "max_episode_tokens=16", model=tiny_model_dir),
                                  "--no-progress"])
    assert "every episode of the batch failed in its environment (8 of 8)" in err, err
    assert "reset: KeyError" in err and "no such colour 'blue'" in err, err
