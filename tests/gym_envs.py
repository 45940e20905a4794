"""A Gymnasium text game for the adapter's tests, registered on import as
``rlhfless-test/Guess-v0`` (``environment = "gymnasium:gym_envs:rlhfless-test/Guess-v0"``;
worker processes import it by name: they inherit the test's sys.path).

``Guess`` draws a number from 0 to ``high`` with the seed ``reset`` gets; each turn's first
integer is a guess, answered "higher" or "lower" until it hits (reward 1, terminated); the
registered id stops it after 3 steps (truncated). ``reset`` records the row it got in
``options`` and ``step`` the turns it read, per episode, in ``LOG``.
"""

from __future__ import annotations

import re
import string

import gymnasium
from gymnasium import spaces

LOG: dict[str, dict] = {}  # "prompt_id#sample" -> {"target", "turns", "rewards"}


def guess_reward(turn: str, target: int) -> float:
    """The game's reward for one turn, written apart from the game for the tests to compare."""
    digits = re.findall(r"\d+", turn)
    return 1.0 if digits and int(digits[0]) == target else 0.0


class Guess(gymnasium.Env):
    def __init__(self, high: int = 9) -> None:
        self.high = high
        self.observation_space = spaces.Text(200, charset=string.printable)
        self.action_space = spaces.Text(2000, charset=string.printable)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.target = int(self.np_random.integers(0, self.high + 1))
        row = (options or {}).get("row", {})
        self.log = LOG[f"{row.get('prompt_id')}#{row.get('sample_idx')}"] = {
            "target": self.target, "turns": [], "rewards": [], "seed": seed}
        return f"Guess a number from 0 to {self.high}.\nAnswer:", {}

    def step(self, action):
        reward = guess_reward(action, self.target)
        self.log["turns"].append(action)
        self.log["rewards"].append(reward)
        digits = re.findall(r"\d+", action)
        hint = "higher" if digits and int(digits[0]) < self.target else "lower"
        return f" {hint}\nAnswer:", reward, reward == 1.0, False, {}


gymnasium.register(id="rlhfless-test/Guess-v0", entry_point=Guess, max_episode_steps=3)
