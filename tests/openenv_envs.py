"""OpenEnv environments for the adapter's tests, written as OpenEnv's template writes them
(``openenv.core.env_server``'s ``Environment``, pydantic ``Action`` and ``Observation``
types); worker processes import this module by name (they inherit the test's sys.path).

``GuessEnvironment`` draws a number from 0 to ``high`` with the seed ``reset`` gets; each
action's ``guess`` (its first integer) is answered in ``hint`` ("higher"/"lower", reward 0)
until it hits (reward 1, done) or ``max_steps`` pass (done). ``LOG`` records per episode id
the seed, the target and the guesses read. ``EvalEnvironment`` adds up ``code`` (``"1 + 2"``)
and answers with ``stdout``, ``stderr`` and ``exit_code``, the fields of OpenEnv's coding
environment, and its ``reset`` takes no argument (the template's). ``TwoTextEnvironment``'s
action has two text fields.
"""

from __future__ import annotations

import random
import re
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

LOG: dict[str, dict] = {}  # episode_id -> {"seed", "target", "guesses"}


class GuessAction(Action):
    guess: str = Field(..., description="the model's turn")


class GuessObservation(Observation):
    hint: str = Field(default="", description="what the game says")


def guess_reward(turn: str, target: int) -> float:
    """The game's reward for one turn, written apart from the game for the tests to compare."""
    digits = re.findall(r"\d+", turn)
    return 1.0 if digits and int(digits[0]) == target else 0.0


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, high: int = 9, max_steps: int = 3) -> None:
        super().__init__()
        self.high, self.max_steps = high, max_steps
        self._state = State(episode_id=str(uuid4()), step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
        self.target = random.Random(seed).randint(0, self.high)
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.log = LOG[self._state.episode_id] = {"seed": seed, "target": self.target,
                                                  "guesses": []}
        return GuessObservation(hint=f"Guess a number from 0 to {self.high}.\nAnswer:")

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        self.log["guesses"].append(action.guess)
        reward = guess_reward(action.guess, self.target)
        digits = re.findall(r"\d+", action.guess)
        hint = "higher" if digits and int(digits[0]) < self.target else "lower"
        done = reward == 1.0 or self._state.step_count >= self.max_steps
        return GuessObservation(hint=f" {hint}\nAnswer:", reward=reward, done=done)

    @property
    def state(self) -> State:
        return self._state


class CodeAction(Action):
    code: str


class EvalObservation(Observation):
    stdout: str = ""
    stderr: str = ""
    exit_code: int = 0


class EvalEnvironment(Environment):
    def reset(self) -> EvalObservation:  # the template's bare reset
        return EvalObservation(stdout="ready")

    def step(self, action: CodeAction) -> EvalObservation:  # type: ignore[override]
        try:
            total = sum(int(term) for term in action.code.split("+"))
            return EvalObservation(stdout=str(total), reward=1.0, done=True)
        except ValueError as err:
            return EvalObservation(stderr=type(err).__name__, exit_code=1)

    @property
    def state(self) -> State:
        return State()


class TwoTextAction(Action):
    a: str
    b: str


class TwoTextEnvironment(Environment):
    def reset(self) -> EvalObservation:
        return EvalObservation()

    def step(self, action: TwoTextAction) -> EvalObservation:  # type: ignore[override]
        return EvalObservation(done=True)

    @property
    def state(self) -> State:
        return State()
