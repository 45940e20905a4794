"""Tasks and environments of other libraries, used unchanged, by name.

    environment = "skyrl-gym:<id>"         skyrl_gym.py   (skyrl-gym's BaseTextEnv)
    environment = "textarena:<env id>"     textarena.py   (a single-player TextArena game)
    environment = "gymnasium:<module>:<id>" gymnasium.py  (a Gymnasium text env the module
                                           registers; a Gymnasium-style class by module path)
    environment = "openenv:<module>:<Class>" openenv.py  (an OpenEnv Environment class, run
                                           in process)
    dataset = "reasoning-gym:<task>"       reasoning_gym.py (its generator; its scorer as
                                           the reward "reasoning-gym:<task>")

Each library is imported only when its adapter is used, so none is a dependency; a missing
one is a one-line error naming the package to install. ``_`` spellings of the prefixes
(``skyrl_gym:``, ``reasoning_gym:``) are the same names.
"""

from __future__ import annotations

from .gymnasium import GymnasiumEnv
from .openenv import OpenEnvEnv
from .skyrl_gym import SkyrlGymEnv
from .textarena import TextArenaEnv

ENVIRONMENT_ADAPTERS = {"skyrl-gym": SkyrlGymEnv, "textarena": TextArenaEnv,
                        "gymnasium": GymnasiumEnv, "openenv": OpenEnvEnv}
DATASET_ADAPTERS = ("reasoning-gym",)  # dataset and reward names: reasoning_gym.py
LIBRARY_PREFIX = {"skyrl_gym": "skyrl-gym", "textarena": "textarena",
                  "reasoning_gym": "reasoning-gym"}  # top-level module -> prefix


def adapter_of(name: str, table):
    """``(table[prefix], id)`` when ``name`` is ``"<prefix>:<id>"`` of ``table`` (a dict, or
    a tuple of prefixes, then ``(prefix, id)``); None for any other name."""
    prefix, sep, ident = name.partition(":")
    prefix = prefix.replace("_", "-")
    if not sep or prefix not in table:
        return None
    if not ident:
        raise ValueError(f"{name!r}: give the {prefix} id after the colon, e.g. "
                         f"'{prefix}:{EXAMPLE_IDS[prefix]}'")
    return (table[prefix] if isinstance(table, dict) else prefix), ident


EXAMPLE_IDS = {"skyrl-gym": "gsm8k_multi_turn", "textarena": "GuessTheNumber-v0",
               "gymnasium": "mytask.envs:Guess-v0", "openenv": "my_env.server:MyEnvironment",
               "reasoning-gym": "basic_arithmetic"}
