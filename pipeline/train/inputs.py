"""What a configuration points at, checked in the driver before a run directory exists or
any worker starts: each bad path or reward is a ``ConfigError`` of one line that names the
key, the problem and the fix.

* ``dataset`` / ``heldout``: a file (not a directory) that exists, when given; a dataset
  ``"reasoning-gym:<task>"``: the package is installed and has the task.
* ``given_prompts``: prompts given from Python as objects (``train(cfg, dataset=df)``) become
  files of the run, named by their content, that ``dataset`` / ``heldout`` then point at.
* ``model``: ``"tiny"`` or a directory with a Hugging Face ``config.json``.
* ``default_reward``: a built-in verifier; each of ``rewards``: a verifier, a library's
  scorer (``"reasoning-gym:<task>"``), or ``"module:function"`` that imports here and names a
  callable.
* ``environment``: it resolves (imports, is a class with ``reset`` and ``step``, or a
  library's id) and one is built with ``env_kwargs`` (and closed); with ``env_prompts``,
  its reset for seed 0 makes a first observation (the first prompt).
* ``tiny_context``: ``model`` is ``"tiny"`` or a directory the tiny builder made.
* ``fit_context``: once the prompts are read, the longest prompt plus the tokens generated
  after it (``max_new_tokens``, or ``max_episode_tokens`` for episodes) fit the model's
  context, the embedded tiny model's grown to fit where ``tiny_context`` is unset; the
  worst prompt is named. The working directory is
  put on ``sys.path`` first (the ``rlhfless`` script does not have it), so that a reward
  module beside the config imports; local workers inherit the driver's ``sys.path``, and a
  batch job's worker starts in the directory the job was submitted from.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pa_compute
import pyarrow.parquet as pq

from rlhfless.ops.data.records import in_memory_table
from rlhfless.ops.rollouts.adapters import reasoning_gym
from rlhfless.ops.rollouts.resolve import resolve_environment
from rlhfless.ops.rollouts.reward import describe_error
from rlhfless.ops.toy.tinymodel import with_context

from ..config import Config, ConfigError, dataset_task
from ..specs import env_prompt_table, run_rewards
from ..tasks.scoring import VERIFIERS, resolve_reward

GIVEN_DIR = "inputs"  # in the run directory: the prompts given as objects (given_prompts)


def given_prompts(cfg: Config, **given: Any) -> tuple[Config, dict[str, pa.Table]]:
    """``cfg`` with each of ``dataset`` / ``heldout`` given as an in-memory source (a
    ``pyarrow.Table``, ``datasets.Dataset`` or pandas ``DataFrame``; None: not given) set to
    the path of its copy in the run, ``<run>/inputs/<key>-<digest>.parquet``, and the table
    of each key to write there (``write_given_prompts``, once the run directory is held).
    The name is the rows' digest, so a resume given the same rows names the same file, and
    one given other rows changes ``dataset``, which a resume refuses. A key both in ``cfg``
    and given, or an object that is not a source, is a ``ConfigError``."""
    tables: dict[str, pa.Table] = {}
    for key, source in given.items():
        if source is None:
            continue
        if getattr(cfg, key):
            raise ConfigError(f"{key} is given twice: {key} = {getattr(cfg, key)!r} in the "
                              f"configuration and a {type(source).__name__} to train(); give one")
        try:
            table = in_memory_table(source)[2].replace_schema_metadata(None)
        except TypeError as err:
            raise ConfigError(f"train({key}=...): {err}") from None
        tables[key] = table
        path = cfg.run_dir / GIVEN_DIR / f"{key}-{_digest(table)}.parquet"
        cfg = replace(cfg, **{key: str(path)})
    return cfg, tables


def write_given_prompts(cfg: Config, tables: dict[str, pa.Table]) -> None:
    """Write each table of ``given_prompts`` to the path its key has in ``cfg`` (a temporary
    name renamed into place), unless a resumed run has it already: its name is its content."""
    for key, table in tables.items():
        path = Path(getattr(cfg, key))
        if path.exists():
            continue
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, path)


def _digest(table: pa.Table) -> str:
    """16 hex digits of BLAKE2b over the table's Arrow IPC stream (schema and rows)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return hashlib.blake2b(sink.getvalue().to_pybytes(), digest_size=8).hexdigest()


def check_inputs(cfg: Config, given: frozenset[str] = frozenset()) -> None:
    """Raise ``ConfigError`` for the first path or reward of ``cfg`` that cannot work; the
    keys in ``given`` name files ``write_given_prompts`` has yet to write."""
    for key in ("dataset", "heldout"):
        value = getattr(cfg, key)
        if not value or key in given or key == "dataset" and dataset_task(value):
            continue
        path = Path(value)
        if path.is_dir():
            raise ConfigError(f"{key} = {value!r} is a directory; give a .jsonl, .json or "
                              ".parquet file of prompts")
        if not path.is_file():
            raise ConfigError(f"{key} = {value!r}: no such file; give the path of a .jsonl, "
                              ".json or .parquet file of prompts (relative to the working "
                              "directory)")
    if dataset_task(cfg.dataset):  # drawn when the prompts are read (specs.dataset_source)
        try:
            reasoning_gym.check_task(dataset_task(cfg.dataset))
        except ValueError as err:
            raise ConfigError(f"dataset = {cfg.dataset!r}: {err}") from None
    if cfg.model != "tiny" and not (Path(cfg.model) / "config.json").is_file():
        raise ConfigError(f"model = {cfg.model!r}: no Hugging Face config.json there; give a "
                          "model directory or 'tiny'")
    if cfg.tiny_context and cfg.model != "tiny" and not (Path(cfg.model) / "recipe.json"
                                                         ).is_file():
        raise ConfigError(f"tiny_context = {cfg.tiny_context} is for the embedded tiny model: "
                          f"model = {cfg.model!r} is not one (no recipe.json); remove it")
    check_rewards(cfg)
    check_environment(cfg)


def _working_directory_on_path() -> None:
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)


def check_environment(cfg: Config) -> None:
    """Each environment of ``cfg`` (``environment``, and each of ``environments``) resolves
    here and one is built with its ``env_kwargs``."""
    checks = [(f"environments.{source}", name, kwargs)
              for source, (name, kwargs) in cfg.environment_routes().items()]
    if cfg.episode_environment:
        checks.insert(0, ("environment", cfg.episode_environment, cfg.env_kwargs))
    for key, name, kwargs in checks:
        _check_one_environment(key, name, kwargs)
    if cfg.env_prompts:  # the first game: a reset that makes no prompt is refused here
        env_prompt_table(cfg, range(1))


def check_routes(cfg: Config, prompts: dict) -> None:
    """With ``environments`` and no ``environment``, every ``data_source`` of the prompt sets
    has an environment; the first without one is named."""
    if not cfg.environments or cfg.episode_environment:
        return
    for name, table in prompts.items():
        for source in pa_compute.unique(table.column("data_source")).to_pylist():
            if source not in cfg.environments:
                raise ConfigError(f"{name}: data_source {source!r} has no environment; add it "
                                  f"to [environments] ({', '.join(sorted(cfg.environments))} "
                                  "have one) or set environment for every other source")


def _check_one_environment(key: str, name: str, kwargs: dict) -> None:
    """``name`` resolves and one is built with ``kwargs`` (and closed); ``key`` names it."""
    _working_directory_on_path()
    try:
        make = resolve_environment(name)
    except Exception as err:  # the user's module may raise anything while importing
        raise ConfigError(f"{key} = {name!r} cannot be used: {describe_error(err)}"
                          ) from None
    try:
        env = make(**kwargs)
    except Exception as err:
        raise ConfigError(f"{key} = {name!r} cannot be built with env_kwargs = "
                          f"{kwargs}: {describe_error(err)}") from None
    close = getattr(env, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # an environment never reset may fail to close; reset comes later
            pass


def fit_context(cfg: Config, model_path: Path, prompts: dict, log=print) -> Path:
    """The model directory to run: ``model_path`` when the longest prompt of each set plus
    what is generated after it fits its context (``max_position_embeddings`` of its
    config.json, when it says); for the embedded tiny model (``"tiny"`` or a directory it
    built) without ``tiny_context``, the same weights at the smallest power-of-two context
    that holds it (``with_context``, said through ``log``); else a ``ConfigError`` naming
    the worst prompt, what it needs and the fix (an environment's first observation is the
    game's own: it names the game)."""
    limit = json.loads((Path(model_path) / "config.json").read_text()).get(
        "max_position_embeddings")
    if not isinstance(limit, int):
        return model_path
    after, key = ((cfg.max_episode_tokens, "max_episode_tokens") if cfg.multi_turn
                  else (cfg.max_new_tokens, "max_new_tokens"))
    longest = []  # per set: (tokens, prompt id, set) of its longest prompt
    for name, table in prompts.items():
        lengths = pa_compute.list_value_length(table.column("prompt_ids")).to_pylist()
        if lengths:
            i = max(range(len(lengths)), key=lengths.__getitem__)
            longest.append((lengths[i], table.column("prompt_id")[i].as_py(), name))
    if not longest or max(longest)[0] + after <= limit:
        return model_path
    length, prompt_id, name = max(longest, key=lambda w: w[0])
    need, fits = length + after, 1 << (length + after - 1).bit_length()
    said = f"prompt {prompt_id!r} is {length} tokens, + {key} = {after} is {need}"
    tiny = (Path(model_path) / "recipe.json").is_file()
    if tiny and not cfg.tiny_context:
        log(f"the tiny model runs at a context of {fits} tokens (tiny_context; its weights as "
            f"built for {limit}): {said}")
        return with_context(model_path, fits)
    fix = (f"tiny_context = {fits} runs the embedded model at a context that holds it" if tiny
           else f"give a model whose context holds {need} tokens")
    if cfg.env_prompts:
        raise ConfigError(f"environment {cfg.environment!r}: its first observation, {said}, "
                          f"over the model's context of {limit} tokens; {fix}, or lower {key}")
    raise ConfigError(f"{name}: {said}, over the model's context of {limit} tokens; {fix}, "
                      f"or lower max_prompt_tokens (on_long_prompt decides what happens to "
                      f"longer prompts) or {key}")


def check_rewards(cfg: Config) -> None:
    """Every reward of ``cfg`` resolves here, in the driver, to a callable."""
    _working_directory_on_path()
    if cfg.default_reward not in VERIFIERS:
        raise ConfigError(f"default_reward = {cfg.default_reward!r} is not a verifier; choose "
                          f"one of {sorted(VERIFIERS)} (a function of your own goes in "
                          "[rewards], by data_source)")
    for source, name in run_rewards(cfg).items():
        key = f"rewards.{source}"
        if name in VERIFIERS:
            continue
        try:
            fn = resolve_reward(name)
        except Exception as err:  # the user's module may raise anything while importing
            raise ConfigError(
                f"{key} = {name!r} does not import ({describe_error(err)}); give a "
                f"verifier {sorted(VERIFIERS)}, 'reasoning-gym:<task>' or 'module:function' "
                "importable from the working directory") from None
        if not callable(fn):
            raise ConfigError(f"{key} = {name!r} is a {type(fn).__name__}, not a function "
                              "fn(response_text, answer) -> float")
