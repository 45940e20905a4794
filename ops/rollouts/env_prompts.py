"""Prompts an environment makes itself: the first observation of a seeded episode.

Games (TextArena, Gymnasium, OpenEnv environments) make their first observation in
``reset``; with ``env_prompts = N`` and no dataset, the run's prompts are those observations:
``env_prompt_records(make, kwargs, name, seeds)`` builds one environment per seed, resets it
with a row that carries the seed (``seed`` and ``episode_seed``: the adapters' ``row_seed``),
keeps the observation and closes it. Each record is a prompt row: ``prompt`` the observation
as it is (text is encoded as it is, chat messages go through the model's chat template, as
any dataset's prompt), ``seed`` the episode's seed, ``data_source`` the environment's name,
``prompt_id`` ``"<name>:<seed>"``, no ``answer`` (the environment scores), and
``PROMPT_FROM_RESET`` set.

Training draws seeds ``0..N-1`` (one epoch); held-out prompts draw from ``HELDOUT_SEED`` on,
a range training never reaches. When the episode is played, ``reset`` runs again with the
row's seed and must give the same observation, which is already the prompt and is not
appended again (``check_replayed``): an environment that does not replay by its seed fails
its episodes, it never trains on a prompt that is not its game's.
"""

from __future__ import annotations

from collections.abc import Callable

from .env import check_observation

HELDOUT_SEED = 1_000_000  # the first held-out seed; training seeds stay below it
PROMPT_FROM_RESET = "prompt_from_reset"  # the record field of a prompt drawn from reset


def _record(name: str, seed: int) -> dict:
    """The fields of the prompt record of ``seed``, but its prompt."""
    return {"prompt_id": f"{name}:{seed}", "data_source": name, "answer": None, "seed": seed}


def env_prompt_records(make: Callable, kwargs: dict, name: str, seeds: range) -> list[dict]:
    """One prompt record per seed: the first observation of ``make(**kwargs)`` reset with
    that seed. ``ValueError`` naming the seed when ``reset`` gives no observation (an
    environment that needs a dataset's prompt) or not text / chat messages."""
    records = []
    for seed in seeds:
        env = make(**kwargs)
        try:
            # the row the episode's reset will get, but the prompt: none yet
            observation = env.reset(_record(name, seed) | {"episode_seed": seed,
                                                           "sample_idx": 0, "prompt_text": ""})
        finally:
            close = getattr(env, "close", None)
            if callable(close):
                close()
        if not observation:
            raise ValueError(f"environment {name!r} gave no first observation for seed {seed}"
                             ": it starts from a dataset's prompt, so give dataset instead "
                             "of env_prompts")
        check_observation(observation, f"reset (seed {seed})")
        records.append(_record(name, seed) | {"prompt": observation, PROMPT_FROM_RESET: True})
    return records


def check_replayed(row: dict, observation: object) -> None:
    """``ValueError`` unless ``observation``, from the episode's ``reset``, is the one its
    prompt was drawn from (the row's ``prompt``)."""
    if observation != row.get("prompt"):
        raise ValueError(f"the first observation for seed {row.get('seed')} is not the one "
                         "its prompt was drawn from: the environment does not replay a game "
                         "by its seed, so env_prompts cannot be used with it")
