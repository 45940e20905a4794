"""What a configuration points at, checked in the driver before a run directory exists or
any worker starts: each bad path or reward is a ``ConfigError`` of one line that names the
key, the problem and the fix.

* ``dataset`` / ``heldout``: a file (not a directory) that exists, when given.
* ``model``: ``"tiny"`` or a directory with a Hugging Face ``config.json``.
* ``default_reward``: a built-in verifier; each of ``rewards``: a verifier, or
  ``"module:function"`` that imports here and names a callable. The working directory is
  put on ``sys.path`` first (the ``rlhfless`` script does not have it), so that a reward
  module beside the config imports; local workers inherit the driver's ``sys.path``, and a
  batch job's worker starts in the directory the job was submitted from.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..config import Config, ConfigError
from ..tasks.scoring import VERIFIERS, resolve_reward


def check_inputs(cfg: Config) -> None:
    """Raise ``ConfigError`` for the first path or reward of ``cfg`` that cannot work."""
    if cfg.backend == "emulated":
        raise ConfigError("backend = 'emulated' runs a workload trace, not a dataset: use "
                          "rlhfless.pipeline.train.emulated.run_emulated (bench/emulated.py)")
    for key in ("dataset", "heldout"):
        value = getattr(cfg, key)
        if not value:
            continue
        path = Path(value)
        if path.is_dir():
            raise ConfigError(f"{key} = {value!r} is a directory; give a .jsonl, .json or "
                              ".parquet file of prompts")
        if not path.is_file():
            raise ConfigError(f"{key} = {value!r}: no such file; give the path of a .jsonl, "
                              ".json or .parquet file of prompts (relative to the working "
                              "directory)")
    if cfg.model != "tiny" and not (Path(cfg.model) / "config.json").is_file():
        raise ConfigError(f"model = {cfg.model!r}: no Hugging Face config.json there; give a "
                          "model directory or 'tiny'")
    check_rewards(cfg)


def check_rewards(cfg: Config) -> None:
    """Every reward of ``cfg`` resolves here, in the driver, to a callable."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    if cfg.default_reward not in VERIFIERS:
        raise ConfigError(f"default_reward = {cfg.default_reward!r} is not a verifier; choose "
                          f"one of {sorted(VERIFIERS)} (a function of your own goes in "
                          "[rewards], by data_source)")
    for source, name in cfg.rewards.items():
        key = f"rewards.{source}"
        if name in VERIFIERS:
            continue
        try:
            fn = resolve_reward(name)
        except Exception as err:  # the user's module may raise anything while importing
            raise ConfigError(
                f"{key} = {name!r} does not import ({type(err).__name__}: {err}); give a "
                f"verifier {sorted(VERIFIERS)} or 'module:function' importable from the "
                "working directory") from None
        if not callable(fn):
            raise ConfigError(f"{key} = {name!r} is a {type(fn).__name__}, not a function "
                              "fn(response_text, answer) -> float")
