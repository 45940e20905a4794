"""Environments for the multi-turn tests, named ``"episode_envs:Class"`` (worker processes
import them by name: they inherit the test's sys.path).

``Scripted`` answers every turn with an observation that names the turn, and ends the episode
after ``turns`` turns; it records, per episode, the turn texts it read and the observations
it gave. ``Faulty`` fails in the way its prompt's ``answer`` says ("raise", "hang",
"garbage" at ``step``, "bad-reset" at ``reset``) and behaves like ``Scripted`` otherwise.
``Unseeded`` makes a first observation that its seed does not fix. ``Graded`` is ``Scripted``
whose step reward depends on the turn (``graded_reward``), so samples' turns differ in it.
"""

from __future__ import annotations

import time

from rlhfless.ops.rollouts.env import Environment, StepResult

LOG: dict[str, dict[str, list[str]]] = {}  # "prompt_id#sample" -> turns read, observations


class Scripted(Environment):
    def __init__(self, turns: int = 3) -> None:
        self.turns = turns

    def reset(self, row: dict) -> str | None:
        self.key = f"{row['prompt_id']}#{row['sample_idx']}"
        self.log = LOG[self.key] = {"turns": [], "observations": []}  # the latest episode
        return None

    def step(self, turn: str) -> StepResult:
        self.log["turns"].append(turn)
        n = len(self.log["turns"])
        observation = f"\nItems: fig pear {'plum ' * n}\nAnswer:"
        self.log["observations"].append(observation)
        return StepResult(observation, 0.25, n >= self.turns)


class Faulty(Scripted):
    def reset(self, row: dict) -> str | None:
        self.fault = row.get("answer")
        if self.fault == "bad-reset":
            return 42  # type: ignore[return-value]
        return super().reset(row)

    def step(self, turn: str) -> StepResult:
        if self.fault == "raise":
            raise RuntimeError("the environment broke")
        if self.fault == "hang":
            time.sleep(30)
        if self.fault == "garbage":
            return {"observation": b"\x00"}  # type: ignore[return-value]
        return super().step(turn)


def graded_reward(turn: str) -> float:
    """``Graded``'s reward of one turn, written apart for the tests to compare."""
    return (len(turn) % 3) / 2


class Graded(Scripted):
    def step(self, turn: str) -> StepResult:
        result = super().step(turn)
        return StepResult(result.observation, graded_reward(turn), result.done)


class Unseeded(Scripted):
    """A game whose first observation counts the resets of its process: it does not replay
    by its seed (``env_prompts`` must refuse its episodes)."""

    resets = 0

    def reset(self, row: dict) -> str:
        super().reset(row)
        Unseeded.resets += 1
        return f"Game {Unseeded.resets}.\nAnswer:"
