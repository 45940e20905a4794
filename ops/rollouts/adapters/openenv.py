"""OpenEnv environments, unchanged: ``environment = "openenv:<module>:<Class>"`` for a class
of OpenEnv's server-side ``Environment`` (``openenv.core.env_server``), run in the episode's
process (no server, no container); a class of that kind given as ``"module:Class"`` is the
same.

Per episode: ``Class(**env_kwargs)`` when the environment is built; ``reset(seed=...,
episode_id=...)`` with the row's ``seed`` if it has one, else the episode's
``episode_seed``, and ``"<prompt_id>#<sample_idx>"`` (each passed only where ``reset``
takes it: OpenEnv's template overrides ``reset()`` bare); each turn goes to
``step(Action(<text field>=turn))`` and the returned ``Observation``'s ``reward`` (None is 0)
and ``done`` are the step's.

An Action and an Observation carry their text in fields of each environment's own: the
action's text field is its one ``str`` field besides ``metadata`` (the action type read from
``step``'s annotation, else from ``Environment[Act, Obs, State]``; an action with none or
several is refused when the environment is built, naming its fields). An observation is
appended as the text of its one field besides ``done``, ``reward`` and ``metadata``, or,
with several (a coding environment's ``stdout``, ``stderr``, ``exit_code``), as one
``name: value`` line per field, in the order the class declares them.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

from ..env import Environment, StepResult, row_seed
from .library import import_class

OBSERVATION_BASE = ("done", "reward", "metadata")  # every OpenEnv Observation's own fields


def openenv_class(cls: type) -> bool:
    """Whether ``cls`` derives from OpenEnv's ``Environment`` (by its module: OpenEnv is not
    imported to ask)."""
    return any(base.__name__ == "Environment" and base.__module__.startswith("openenv.")
               for base in cls.__mro__[1:])


def action_type(cls: type) -> type:
    """The Action class ``cls.step`` takes: its annotation, else the first argument of the
    ``Environment[...]`` it derives from."""
    try:
        hinted = typing.get_type_hints(cls.step).get("action")
    except (NameError, TypeError):  # an annotation that does not resolve
        hinted = None
    if isinstance(hinted, type) and hasattr(hinted, "model_fields"):
        return hinted
    for base in getattr(cls, "__orig_bases__", ()):
        args = typing.get_args(base)
        if args and isinstance(args[0], type) and hasattr(args[0], "model_fields"):
            return args[0]
    raise ValueError(f"OpenEnv environment {cls.__name__}: its action type is not known; "
                     "annotate step(self, action: MyAction) or derive from "
                     "Environment[MyAction, MyObservation, State]")


def text_field(action: type, env: str) -> str:
    """The one ``str`` field of ``action`` besides ``metadata``; ``ValueError`` otherwise."""
    fields = {name: f.annotation for name, f in action.model_fields.items()
              if name != "metadata"}
    text = [name for name, annotation in fields.items() if annotation is str]
    if len(text) != 1:
        raise ValueError(f"OpenEnv environment {env}: its action {action.__name__} has "
                         f"{len(text)} str fields ({', '.join(fields) or 'no fields'}); "
                         "the turn's text goes to an action with exactly one")
    return text[0]


def observation_text(observation: Any) -> str:
    """The observation's own fields as text (see the module docstring)."""
    own = [name for name in type(observation).model_fields if name not in OBSERVATION_BASE]
    if len(own) == 1:
        return str(getattr(observation, own[0]))
    return "\n".join(f"{name}: {getattr(observation, name)}" for name in own)


class OpenEnvEnv(Environment):
    def __init__(self, make: str | type, **env_kwargs) -> None:
        if isinstance(make, str):
            make = import_class(f"openenv:{make}", make)
            if not openenv_class(make):
                raise ValueError(f"environment 'openenv:{make.__module__}:"
                                 f"{make.__name__}' is not an OpenEnv Environment class")
        self.action = action_type(make)
        self.field = text_field(self.action, make.__name__)
        self.env = make(**env_kwargs)  # env_kwargs it does not take: here
        self.reset_takes = inspect.signature(self.env.reset).parameters

    def reset(self, row: dict) -> str:
        offered = {"seed": row_seed(row),
                   "episode_id": f"{row.get('prompt_id')}#{row.get('sample_idx')}"}
        takes_any = any(p.kind is p.VAR_KEYWORD for p in self.reset_takes.values())
        kwargs = {k: v for k, v in offered.items() if takes_any or k in self.reset_takes}
        return observation_text(self.env.reset(**kwargs))

    def step(self, turn: str) -> StepResult:
        observation = self.env.step(self.action(**{self.field: turn}))
        done = bool(observation.done)
        reward = 0.0 if observation.reward is None else float(observation.reward)
        return StepResult("" if done else observation_text(observation), reward, done)

    def close(self) -> None:
        self.env.close()
