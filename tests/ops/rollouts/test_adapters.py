"""The library adapters (ops/rollouts/adapters/) with the real libraries: reasoning-gym's
scorer, skyrl-gym's ``gsm8k_multi_turn`` and TextArena's ``GuessTheNumber-v0``, each compared
with what the library itself says for the same text, and episodes played through
``run_episodes`` on the tiny model.

A test of a library that is not installed is skipped, unless ``RLHFLESS_REQUIRE_ECOSYSTEM=1``
(``.ci/run`` sets it: CI installs them all) makes it fail."""

from __future__ import annotations

import copy
import importlib
import json
import os
from collections import Counter

import pyarrow as pa
import pytest
from model_support import redraw
from test_episode import TEXTS, play, runs, turn_tokenizer  # noqa: F401 (a fixture)

from rlhfless.ops.data.load import read_prompts
from rlhfless.ops.engine.engine_types import SamplingParams
from rlhfless.ops.engine.generate import decode
from rlhfless.ops.engine.rows import expand_samples
from rlhfless.ops.rollouts.adapters import reasoning_gym as rg_adapter
from rlhfless.ops.rollouts.env import StepResult
from rlhfless.ops.rollouts.env_prompts import env_prompt_records
from rlhfless.ops.rollouts.episode import render_messages
from rlhfless.ops.rollouts.resolve import resolve_environment
from rlhfless.ops.rollouts.reward import score
from rlhfless.ops.toy.tinymodel import TinyRecipe, build_model


def library(module: str):
    """The installed library, or skip (fail under RLHFLESS_REQUIRE_ECOSYSTEM=1)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError:
        if os.environ.get("RLHFLESS_REQUIRE_ECOSYSTEM") == "1":
            pytest.fail(f"RLHFLESS_REQUIRE_ECOSYSTEM=1 but {module} is not installed")
        pytest.skip(f"{module} is not installed (pip install -e '.[ecosystem]')")


def turns_of(row: dict, tok) -> list[str]:
    """The text of each generated turn of an episode row, as its environment read it."""
    ids = row["response_ids"]
    return [tok.decode(ids[a:b], skip_special_tokens=True)
            for v, a, b in runs(row["loss_mask"]) if v == 1]


def test_reasoning_gym_rows_are_scored_by_the_task_itself(tokenizer):
    rg = library("reasoning_gym")
    task = "basic_arithmetic"
    entries = list(rg.create_dataset(task, size=6, seed=3))
    loaded = read_prompts(pa.Table.from_pylist(rg_adapter.task_records(task, size=6, seed=3)),
                          tokenizer)
    rows = expand_samples(loaded.table, 3)
    # per prompt: the answer itself, the answer inside more text (partial credit), a miss
    texts = [t for e in entries for t in (e["answer"], f"so it is {e['answer']}", "no idea")]
    rollouts = rows.append_column("response_text", pa.array(texts, pa.string()))
    scored = score(rollouts, {f"reasoning-gym:{task}": rg_adapter.scorer(task)})
    want = [rg.get_score_answer_fn(task)(t, e)
            for e in entries for t in (e["answer"], f"so it is {e['answer']}", "no idea")]
    assert scored.column("reward_error").null_count == len(texts)
    assert scored.column("reward").to_pylist() == want
    assert set(want[0::3]) == {1.0} and 0 < want[1] < 1 and want[2] == 0.0
    # the entry reached the scorer whole: its metadata round-trips
    record = json.loads(loaded.table.column("record")[0].as_py())
    assert json.loads(record["metadata"])["expression"] == entries[0]["metadata"]["expression"]


def test_reasoning_gym_scores_by_the_config_its_rows_were_drawn_with(tokenizer):
    """puzzle24's score_answer checks the numbers against its config's bounds: the same text
    scores 1.0 under the defaults (max_value 10) and 0.01 drawn with max_value 9, as the
    library's own dataset of that config says."""
    rg = library("reasoning_gym")
    text = "10 + 10 + 2 + 2"
    scores = {}
    for config in ({}, {"max_value": 9}):
        records = pa.Table.from_pylist(rg_adapter.task_records("puzzle24", size=2, seed=0,
                                                               **config))
        rollouts = read_prompts(records, tokenizer).table.append_column(
            "response_text", pa.array([text] * len(records), pa.string()))
        scored = score(rollouts, {"reasoning-gym:puzzle24": rg_adapter.scorer("puzzle24")})
        dataset = rg.create_dataset("puzzle24", size=2, seed=0, **config)
        assert scored.column("reward").to_pylist() == [dataset.score_answer(text, e)
                                                       for e in dataset]
        scores[json.dumps(config)] = set(scored.column("reward").to_pylist())
    assert scores == {"{}": {1.0}, '{"max_value": 9}': {0.01}}


def test_skyrl_gym_env_steps_as_the_library_does(tokenizer):
    skyrl = library("skyrl_gym")
    env = resolve_environment("skyrl-gym:gsm8k_multi_turn")()
    row = {"prompt_id": "q", "answer": "42", "prompt_text": "What is 6 * 7?",
           "extra_info": {"max_turns": 3}}
    assert env.reset(row) is None  # init returns the prompt unchanged: nothing to append
    own = skyrl.make("gsm8k_multi_turn", env_config={},
                     extras={"reward_spec": {"ground_truth": "42"},
                             "extra_info": {"max_turns": 3}})
    own.init([{"role": "user", "content": "What is 6 * 7?"}])
    for turn in ("I think #### 41", "#### 42"):
        ours, theirs = env.step(turn), own.step(turn)
        assert (ours.reward, ours.done, ours.observation) == (
            theirs["reward"], theirs["done"], theirs["observations"])
    assert ours.reward == 1.0 and ours.done
    text = render_messages(tokenizer, [{"role": "user", "content": "Try again."}])
    assert text == "<|user|>Try again.\n<|assistant|>"  # the tiny chat template's turn


def test_skyrl_gym_episodes_through_the_rollout_loop(model64, turn_tokenizer):  # noqa: F811
    skyrl = library("skyrl_gym")
    source = [{"prompt": text, "answer": "2", "extra_info": {"max_turns": 3}}
              for text in TEXTS[1:3]]
    prompts = read_prompts(pa.Table.from_pylist(source), turn_tokenizer).table
    table, stats = play(model64, turn_tokenizer, prompts, env="skyrl-gym:gsm8k_multi_turn",
                        n=2, max_turns=3, max_turn_tokens=40, max_episode_tokens=240)
    assert table.column("env_error").null_count == len(table), table.column("env_error")
    observed = 0
    for row in table.to_pylist():
        own = skyrl.make("gsm8k_multi_turn", env_config={},
                         extras={"reward_spec": {"ground_truth": row["answer"]},
                                 "extra_info": {"max_turns": 3}})
        own.init([])
        steps = [own.step(t) for t in turns_of(row, turn_tokenizer)][:len(row["turn_rewards"])]
        assert row["turn_rewards"] == [s["reward"] for s in steps]
        assert row["env_reward"] == sum(s["reward"] for s in steps)
        # each observation is the library's messages through the chat template, as ids
        obs = [row["response_ids"][a:b] for v, a, b in runs(row["loss_mask"]) if v == 0]
        want = [turn_tokenizer(render_messages(turn_tokenizer, s["observations"]),
                               add_special_tokens=False)["input_ids"]
                for s in steps if not s["done"]]
        assert obs == want[:len(obs)]
        observed += len(obs)
    assert observed > 0  # some episode went past its first turn


def test_textarena_game_scores_and_final_reward_at_close():
    library("textarena")
    make = resolve_environment("textarena:GuessTheNumber-v0")
    env = make()
    first = env.reset({"seed": 7, "episode_seed": 1})
    assert "Guess The Number" in first[0]["content"]
    target = env.env.state.game_state["game_number"]
    again = make()
    again.reset({"seed": 7, "episode_seed": 2})  # the row's seed wins: the same game
    assert again.env.state.game_state["game_number"] == target
    wrong = 1 if target != 1 else 2
    step = env.step(f"[{wrong}]")
    assert not step.done and step.observation[0]["content"].strip()
    assert f"[Player] [{wrong}]" in step.observation[0]["content"]  # only what is new
    assert "Guess The Number" not in step.observation[0]["content"]
    done = env.step(f"[{target}]")
    assert (done.reward, done.done) == (1.0, True)
    assert env.close() is None  # scored once, at the step that ended the game
    # our limit ends the game early: close() returns what the game set (here: nothing yet)
    cut = make()
    cut.reset({"seed": 7, "episode_seed": 3})
    cut.step(f"[{wrong}]")
    assert cut.close() is None


@pytest.fixture(scope="module")
def long_model(tokenizer):
    """The tiny Llama with room for TextArena's first observation (424 tokens of the tiny
    tokenizer), float64, random weights."""
    recipe = TinyRecipe(max_positions=1024)
    return redraw(build_model(recipe, tokenizer), recipe.seed).double().eval()


def game_tokenizer(model, tokenizer, first_prompt: str):
    """The tokenizer with the token ``model`` says most often after ``first_prompt`` (greedy)
    as its EOS, so that turns end (as ``test_episode.turn_tokenizer`` does)."""
    ids = [tokenizer(first_prompt, add_special_tokens=False)["input_ids"]]
    said = decode(model, ids, 1, SamplingParams(24, greedy=True), -1, tokenizer.pad_token_id)
    common = Counter(t for tokens, _, _ in said for t in tokens).most_common(1)[0][0]
    tok = copy.deepcopy(tokenizer)
    tok.eos_token = tok.convert_ids_to_tokens(common)
    return tok


def test_textarena_episodes_replay_in_the_library(long_model, tokenizer):
    ta = library("textarena")
    source = [{"prompt": "Play.\n", "seed": s, "answer": ""} for s in (11, 12)]
    first = resolve_environment("textarena:GuessTheNumber-v0")()
    tok = game_tokenizer(long_model, tokenizer, "Play.\n" + render_messages(
        tokenizer, first.reset({"seed": 11})))
    prompts = read_prompts(pa.Table.from_pylist(source), tok).table
    table, _ = play(long_model, tok, prompts, env="textarena:GuessTheNumber-v0",
                    n=2, max_turns=3, max_turn_tokens=16, max_episode_tokens=1000,
                    step_cut_turns=True)
    assert table.column("env_error").null_count == len(table), table.column("env_error")
    seeds = {f"table:{i}": s["seed"] for i, s in enumerate(source)}
    for row in table.to_pylist():
        own = ta.make("GuessTheNumber-v0")
        own.reset(num_players=1, seed=seeds[row["prompt_id"]])
        done = False
        for turn in turns_of(row, tok)[:len(row["turn_rewards"])]:
            done, _ = own.step(turn)
        rewards, _ = own.close()
        final = rewards[0] if rewards else 0.0  # the game's score, whoever ended it
        assert row["env_reward"] == final
        assert done == (row["finish_reason"] == "stop")
    # every turn reached the game (step_cut_turns), which ended or was cut by max_turns
    assert {r["turns"] for r in table.to_pylist()} - {1, 2, 3} == set()
    assert sum(len(r["turn_rewards"]) for r in table.to_pylist()) >= len(table)


def test_gymnasium_env_by_id_and_by_class():
    """A registered id (its module imported by name) and a Gymnasium-style class given by
    module path both play as Gymnasium says: ``reset(seed, options)`` -> (obs, info),
    ``step`` -> 5 values, terminated or truncated (the id's 3-step limit) ends it."""
    library("gymnasium")
    import gym_envs

    by_id = resolve_environment("gymnasium:gym_envs:rlhfless-test/Guess-v0")()
    assert by_id.reset({"seed": 3, "episode_seed": 1, "prompt_id": "p", "sample_idx": 0}) == \
        "Guess a number from 0 to 9.\nAnswer:"
    log = gym_envs.LOG["p#0"]
    assert log["seed"] == 3  # the row's seed wins over the episode's
    target = log["target"]
    first = by_id.step(f" {(target + 1) % 10} items")
    assert not first.done and first.reward == 0.0 and first.observation.endswith("\nAnswer:")
    assert by_id.step(f" {target}") == StepResult("", 1.0, True)  # terminated
    by_id.reset({"episode_seed": 5, "prompt_id": "q", "sample_idx": 1})
    assert gym_envs.LOG["q#1"]["seed"] == 5  # no row seed: the episode's
    misses = [g for g in range(10) if g != gym_envs.LOG["q#1"]["target"]][:3]
    cut = [by_id.step(f" {g}") for g in misses]
    assert [(s.reward, s.done) for s in cut] == [(0.0, False), (0.0, False), (0.0, True)]
    by_id.close()
    by_class = resolve_environment("gym_envs:Guess")(high=3)
    assert by_class.reset({"episode_seed": 2}) == "Guess a number from 0 to 3.\nAnswer:"
    with pytest.raises(ValueError, match="no environment 'nosuch-v0' registered"):
        resolve_environment("gymnasium:nosuch-v0")()
    with pytest.raises(TypeError):
        resolve_environment("gymnasium:gym_envs:rlhfless-test/Guess-v0")(colour="red")


def play_seeded(model, tok, env: str) -> tuple[pa.Table, dict[str, int]]:
    """Two prompts with seeds 21 and 22, two episodes each, played in ``env`` without an
    environment error; returns the table and each prompt_id's seed."""
    source = [{"prompt": text, "answer": "", "seed": s} for s, text in zip((21, 22), TEXTS)]
    prompts = read_prompts(pa.Table.from_pylist(source), tok).table
    table, _ = play(model, tok, prompts, env=env, n=2, max_turns=4, max_turn_tokens=24,
                    max_episode_tokens=180, step_cut_turns=True)
    assert table.column("env_error").null_count == len(table), table.column("env_error")
    return table, {f"table:{i}": s["seed"] for i, s in enumerate(source)}


def test_gymnasium_episodes_replay_in_the_library(model64, turn_tokenizer):  # noqa: F811
    library("gymnasium")
    import gym_envs

    table, seeds = play_seeded(model64, turn_tokenizer,
                               "gymnasium:gym_envs:rlhfless-test/Guess-v0")
    hinted = 0
    for row in table.to_pylist():
        own = gym_envs.Guess()
        first, _ = own.reset(seed=seeds[row["prompt_id"]])
        turns = turns_of(row, turn_tokenizer)[:len(row["turn_rewards"])]
        want = [gym_envs.guess_reward(t, own.target) for t in turns]
        assert row["turn_rewards"] == want and row["env_reward"] == sum(want)
        obs = [row["response_ids"][a:b] for v, a, b in runs(row["loss_mask"]) if v == 0]
        hints = [own.step(t)[0] for t in turns]
        # the first observation (after the prompt), then each hint, token-exact
        assert obs == [turn_tokenizer(text, add_special_tokens=False)["input_ids"]
                       for text in [first, *hints][:len(obs)]]
        assert row["turns"] <= 3  # the registered time limit cut it
        hinted += len(obs) > 1
    assert hinted > 0  # some episode went past its first guess


def test_prompts_drawn_from_the_environment_replay_by_seed(model64, turn_tokenizer):  # noqa: F811
    """``env_prompts``: each prompt is the first observation of its seed's game; the
    episode's reset gives it again, so it is not appended again and the game replays by the
    seed. A game whose first observation its seed does not fix fails its episodes."""
    library("gymnasium")
    import gym_envs

    name = "gymnasium:gym_envs:rlhfless-test/Guess-v0"
    records = env_prompt_records(resolve_environment(name), {}, name, range(3, 5))
    assert [(r["prompt_id"], r["seed"]) for r in records] == [(f"{name}:3", 3), (f"{name}:4", 4)]
    assert {r["prompt"] for r in records} == {"Guess a number from 0 to 9.\nAnswer:"}
    prompts = read_prompts(pa.Table.from_pylist(records), turn_tokenizer).table
    table, _ = play(model64, turn_tokenizer, prompts, env=name, n=2, max_turns=3,
                    max_turn_tokens=24, max_episode_tokens=180, step_cut_turns=True)
    for row in table.to_pylist():
        assert row["env_error"] is None, row["env_error"]
        assert row["loss_mask"][0] == 1  # the model's turn comes first: nothing appended
        own = gym_envs.Guess()
        own.reset(seed=int(row["prompt_id"].rsplit(":", 1)[1]))
        turns = turns_of(row, turn_tokenizer)[:len(row["turn_rewards"])]
        assert turns and row["turn_rewards"] == [gym_envs.guess_reward(t, own.target)
                                                 for t in turns]
    unseeded = env_prompt_records(resolve_environment("episode_envs:Unseeded"), {}, "u",
                                  range(2))
    table, _ = play(model64, turn_tokenizer, read_prompts(
        pa.Table.from_pylist(unseeded), turn_tokenizer).table, env="episode_envs:Unseeded", n=1)
    assert all("does not replay a game by its seed" in error
               for error in table.column("env_error").to_pylist())


def test_an_environment_per_data_source(model64, turn_tokenizer):  # noqa: F811
    """``routes``: each row's episode is played in its ``data_source``'s environment, with
    that route's kwargs; a source without one, and no default, fails its episodes only."""
    library("gymnasium")
    import episode_envs

    source = [{"prompt": TEXTS[0], "answer": "", "data_source": "guess", "seed": 4},
              {"prompt": TEXTS[1], "answer": "", "data_source": "chat"},
              {"prompt": TEXTS[2], "answer": "", "data_source": "other"}]
    prompts = read_prompts(pa.Table.from_pylist(source), turn_tokenizer).table
    episode_envs.LOG.clear()
    table, _ = play(model64, turn_tokenizer, prompts, env="", n=2, max_turns=3,
                    max_turn_tokens=24, max_episode_tokens=180, step_cut_turns=True,
                    routes={"guess": ("gymnasium:gym_envs:rlhfless-test/Guess-v0", {}),
                            "chat": ("episode_envs:Scripted", {"turns": 1})})
    by_source = {}
    for row in table.to_pylist():
        by_source.setdefault(row["data_source"], []).append(row)
    first = turn_tokenizer("Guess a number from 0 to 9.\nAnswer:",
                           add_special_tokens=False)["input_ids"]
    for row in by_source["guess"]:
        assert row["env_error"] is None
        assert row["response_ids"][:len(first)] == first  # the game's reset, then the turns
    for row in by_source["chat"]:
        assert row["env_error"] is None and row["turn_rewards"] == [0.25]  # Scripted, 1 turn
        assert f"{row['prompt_id']}#{row['sample_idx']}" in episode_envs.LOG
    assert len(episode_envs.LOG) == 2  # only the chat rows reached Scripted
    for row in by_source["other"]:
        assert "data_source 'other' has no environment" in row["env_error"]


def test_openenv_env_by_prefix_and_by_class():
    """An OpenEnv ``Environment`` plays as OpenEnv says: ``reset(seed, episode_id)`` and
    ``step(Action)`` -> ``Observation(done, reward, ...)``, the turn in the action's one text
    field, the observation's own field as the text appended; several fields as lines."""
    library("openenv")
    import openenv_envs

    env = resolve_environment("openenv:openenv_envs:GuessEnvironment")(max_steps=3)
    assert env.reset({"seed": 3, "episode_seed": 1, "prompt_id": "p", "sample_idx": 0}) == \
        "Guess a number from 0 to 9.\nAnswer:"
    log = openenv_envs.LOG["p#0"]
    assert log["seed"] == 3  # the row's seed wins over the episode's
    first = env.step(f" {(log['target'] + 1) % 10} items")
    assert first.observation.endswith("\nAnswer:") and (first.reward, first.done) == (0.0, False)
    assert env.step(f" {log['target']}") == StepResult("", 1.0, True)
    assert log["guesses"] == [f" {(log['target'] + 1) % 10} items", f" {log['target']}"]
    env.close()
    by_class = resolve_environment("openenv_envs:GuessEnvironment")(high=3)  # no prefix
    assert by_class.reset({"episode_seed": 2}) == "Guess a number from 0 to 3.\nAnswer:"
    code = resolve_environment("openenv:openenv_envs:EvalEnvironment")()
    assert code.reset({"episode_seed": 0}) == "stdout: ready\nstderr: \nexit_code: 0"
    assert code.step("1 + x") == StepResult("stdout: \nstderr: ValueError\nexit_code: 1",
                                            0.0, False)
    assert code.step("1 + 2") == StepResult("", 1.0, True)
    with pytest.raises(ValueError, match="TwoTextAction has 2 str fields"):
        resolve_environment("openenv:openenv_envs:TwoTextEnvironment")()
    with pytest.raises(ValueError, match="is not an OpenEnv Environment class"):
        resolve_environment("openenv:gym_envs:Guess")()
    with pytest.raises(TypeError):
        resolve_environment("openenv:openenv_envs:GuessEnvironment")(colour="red")


def test_openenv_episodes_replay_in_the_library(model64, turn_tokenizer):  # noqa: F811
    library("openenv")
    import openenv_envs

    table, seeds = play_seeded(model64, turn_tokenizer, "openenv:openenv_envs:GuessEnvironment")
    for row in table.to_pylist():
        own = openenv_envs.GuessEnvironment()
        first = own.reset(seed=seeds[row["prompt_id"]]).hint
        turns = turns_of(row, turn_tokenizer)[:len(row["turn_rewards"])]
        want = [openenv_envs.guess_reward(t, own.target) for t in turns]
        assert row["turn_rewards"] == want and row["env_reward"] == sum(want)
        obs = [row["response_ids"][a:b] for v, a, b in runs(row["loss_mask"]) if v == 0]
        hints = [own.step(openenv_envs.GuessAction(guess=t)).hint for t in turns]
        assert obs == [turn_tokenizer(text, add_special_tokens=False)["input_ids"]
                       for text in [first, *hints][:len(obs)]]
