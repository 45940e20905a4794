"""Gymnasium-style text environments, unchanged: ``environment = "gymnasium:<module>:<id>"``
for an id that ``module`` registers when imported (``gymnasium.register``; the module is
imported in every process that builds one, as ``gymnasium.make("module:id")`` does), or
``"gymnasium:<id>"`` for one registered already; or ``"package.module:Class"`` for a class
whose ``reset`` takes ``seed`` and no row (``gymnasium_style``), a ``gymnasium.Env`` or not.

Per episode: ``gymnasium.make(id, **env_kwargs)`` (the id's registered wrappers, a
``max_episode_steps`` time limit among them) or ``Class(**env_kwargs)`` when the environment
is built; ``reset(seed=..., options={"row": row})`` with the row's ``seed`` if it has one,
else the episode's ``episode_seed`` (``options`` only where ``reset`` takes it), whose
``(observation, info)`` gives the first observation; each turn goes to ``step(turn)``, whose
``(observation, reward, terminated, truncated, info)`` ends the episode when either flag is
set. Observations are text or chat messages (a ``gymnasium.spaces.Text`` space); anything
else fails the episode, as the protocol says (``env.check_observation``).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from ..env import Environment, StepResult, row_seed
from .library import import_library


def gymnasium_style(cls: type) -> bool:
    """Whether ``cls.reset`` is Gymnasium's ``reset(*, seed=None, options=None)``: it takes a
    ``seed`` and needs no positional argument (ours needs the row)."""
    try:
        params = list(inspect.signature(cls.reset).parameters.values())[1:]  # after self
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    required = [p for p in params if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return not required and any(p.name == "seed" for p in params)


class GymnasiumEnv(Environment):
    def __init__(self, make: str | Callable[..., Any], **env_kwargs) -> None:
        if isinstance(make, str):
            gym = import_library("gymnasium", "gymnasium")
            module, _, env_id = make.rpartition(":")
            if module:
                importlib.import_module(module)  # it registers its ids
            if env_id not in gym.registry:
                raise ValueError(f"gymnasium has no environment {env_id!r} registered; name "
                                 "the module that registers it: 'gymnasium:<module>:<id>'")
            self.env = gym.make(env_id, **env_kwargs)  # env_kwargs it does not take: here
        else:
            self.env = make(**env_kwargs)
        self.takes_options = "options" in inspect.signature(self.env.reset).parameters

    def reset(self, row: dict) -> Any:
        options = {"options": {"row": row}} if self.takes_options else {}
        result = self.env.reset(seed=row_seed(row), **options)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(f"reset returned {type(result).__name__}, expected Gymnasium's "
                            "(observation, info)")
        return result[0]

    def step(self, turn: str) -> StepResult:
        result = self.env.step(turn)
        if not (isinstance(result, tuple) and len(result) == 5):
            raise TypeError(f"step returned {type(result).__name__}, expected Gymnasium's "
                            "(observation, reward, terminated, truncated, info)")
        observation, reward, terminated, truncated, _ = result
        done = bool(terminated) or bool(truncated)
        return StepResult("" if done else observation, float(reward), done)

    def close(self) -> None:
        self.env.close()
