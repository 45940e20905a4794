"""From a configured ``environment`` name to what builds one episode's environment.

    "python", "tally-tool"         built in (``env.BUILTIN_ENVIRONMENTS``)
    "skyrl-gym:<id>"               a skyrl-gym environment, unchanged (adapters/skyrl_gym.py)
    "textarena:<env id>"           a single-player TextArena game (adapters/textarena.py)
    "gymnasium:<module>:<id>"      a Gymnasium text environment (adapters/gymnasium.py)
    "openenv:<module>:<Class>"     an OpenEnv Environment class, in process (adapters/openenv.py)
    "package.module:Class"         a user class: an ``Environment``, or any class with
                                   ``reset(row)`` and ``step(turn)`` (duck-typed), or one
                                   with Gymnasium's ``reset(seed=...)`` or OpenEnv's base
                                   (adapted)

``resolve_environment`` returns a callable that takes the ``env_kwargs`` and returns a fresh
environment; a name that cannot work raises ``ValueError`` (or what importing raised), so
the driver can refuse it in one line before anything starts (``pipeline/train/inputs.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from .adapters import ENVIRONMENT_ADAPTERS, LIBRARY_PREFIX, adapter_of
from .adapters.gymnasium import GymnasiumEnv, gymnasium_style
from .adapters.library import import_class
from .adapters.openenv import OpenEnvEnv, openenv_class
from .env import BUILTIN_ENVIRONMENTS, Environment


def resolve_environment(name: str) -> Callable[..., Environment]:
    """A built-in environment class, an adapter bound to its library id, or a user class
    (bound to the OpenEnv adapter when it derives from OpenEnv's ``Environment``, to the
    Gymnasium adapter when its ``reset`` is Gymnasium's)."""
    adapter = adapter_of(name, ENVIRONMENT_ADAPTERS)
    if adapter is not None:
        cls, ident = adapter
        return partial(cls, ident)
    target = BUILTIN_ENVIRONMENTS.get(name, name)
    if ":" not in target:
        raise ValueError(f"environment {name!r}: not one of {sorted(BUILTIN_ENVIRONMENTS)}, "
                         f"'<library>:<id>' ({', '.join(sorted(ENVIRONMENT_ADAPTERS))}) or "
                         "'package.module:Class'")
    cls = import_class(name, target)
    if openenv_class(cls):
        return partial(OpenEnvEnv, cls)
    library = cls.__module__.split(".")[0]
    if library in LIBRARY_PREFIX:
        raise ValueError(f"environment {name!r} is a {library} class: name it "
                         f"'{LIBRARY_PREFIX[library]}:<id>' (its registered id) instead")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"environment {name!r} is not an environment: it has no "
                         f"{' and no '.join(missing)} method (see ops/rollouts/env.py "
                         "Environment; skyrl-gym and TextArena classes go by "
                         "'skyrl-gym:<id>' / 'textarena:<env id>')")
    return partial(GymnasiumEnv, cls) if gymnasium_style(cls) else cls
