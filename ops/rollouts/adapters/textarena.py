"""Single-player TextArena games, unchanged: ``environment = "textarena:<env id>"``.

Per episode: ``textarena.make(env_id, **env_kwargs)`` when the environment is built (the
id's own wrappers included; a keyword the game does not take fails there, in the driver's
check before the run starts), ``reset(num_players=1, seed=...)`` with the row's ``seed`` if
it has one, else the episode's ``episode_seed``; the game's observation is appended as a
user message through the model's chat template. Each turn goes to ``step(turn)``; the game's
observation text grows by what happened since (TextArena's observation wrappers return the
whole history), and only that new part is appended. The game scores at its end: when
``step`` says done, ``close()``'s reward for player 0 is that turn's reward; when our
``max_turns`` or a token limit ends the episode first, ``close()``'s reward, if the game has
set one, is the episode's final reward.

TextArena seeds Python's global ``random`` in ``reset`` and draws the game from it right
after; resets are therefore serialised by one lock, so that episodes on parallel
environment threads draw the games their seeds name.
"""

from __future__ import annotations

import threading

from ..env import Environment, StepResult, row_seed
from .library import import_library

_RESET_LOCK = threading.Lock()  # TextArena's reset seeds and draws from the global random


class TextArenaEnv(Environment):
    def __init__(self, env_id: str, **env_kwargs) -> None:
        self.ta = import_library("textarena", "textarena")
        from textarena.envs.registration import ENV_REGISTRY

        if env_id not in ENV_REGISTRY:
            raise ValueError(f"textarena has no game {env_id!r}; e.g. GuessTheNumber-v0, "
                             "Wordle-v0, Hangman-v0 (textarena.envs.registration.ENV_REGISTRY)")
        self.env = self.ta.make(env_id, **env_kwargs)  # env_kwargs it does not take: here
        self.seen, self.closed, self.started = "", False, False

    def reset(self, row: dict) -> list[dict]:
        self.started = True
        with _RESET_LOCK:
            self.env.reset(num_players=1, seed=row_seed(row))
        return self._observation()

    def _observation(self) -> list[dict]:
        _, text = self.env.get_observation()
        text = text if isinstance(text, str) else str(text)
        new = text[len(self.seen):] if text.startswith(self.seen) else text
        self.seen = text
        return [{"role": "user", "content": new}] if new.strip() else []

    def step(self, turn: str) -> StepResult:
        done, _ = self.env.step(turn)
        if done:
            return StepResult([], self._final_reward() or 0.0, True)
        return StepResult(self._observation(), 0.0, False)

    def _final_reward(self) -> float | None:
        """Player 0's reward from ``close()`` (once), or None if the game set none."""
        if self.closed or not self.started:
            return None
        self.closed = True
        rewards, _ = self.env.close()
        return float(rewards[0]) if rewards else None

    def close(self) -> float | None:
        return self._final_reward()
