"""What ``rlhfless config`` prints: every configuration key with its default and meaning, and
the example configurations that ship with the package (``pipeline/examples/*.toml``).

A key's meaning is the comment beside its field in ``pipeline/config.py``, the one place keys
are declared (an elastic knob's, beside its field in ``schedulers/scaling_policy.py``), read
from the source: a field without one is an error of ``key_meanings``, so a new key cannot go
undocumented. ``listing()`` is itself a TOML file of the defaults, one ``key = default  #
meaning`` line per key, in declaration order.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import re
import tokenize
from importlib import resources
from typing import Any

from rlhfless.schedulers.scaling_policy import ScalingKnobs

from .config import Config, ConfigError

BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
LISTING_WIDTH = 36  # meanings start in this column unless the key and default are longer


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment on the line where the field of dataclass ``cls`` starts."""
    source = inspect.getsource(cls)
    body = ast.parse(source).body[0].body
    starts = {node.lineno: node.target.id for node in body
              if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    return {starts[tok.start[0]]: tok.string.lstrip("#").strip()
            for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT and tok.start[0] in starts}


def key_meanings() -> dict[str, str]:
    """Every key of ``Config`` -> its one-line meaning, in declaration order."""
    own, knobs = field_comments(Config), field_comments(ScalingKnobs)
    meanings = {f.name: own.get(f.name) or knobs.get(f.name, "")
                for f in dataclasses.fields(Config)}
    missing = [key for key, meaning in meanings.items() if not meaning]
    if missing:
        raise ValueError(f"config keys without a comment beside their field: {missing}")
    return meanings


def toml_value(value: Any) -> str:
    """``value`` (a default of ``Config``) written as TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = (f"{k if BARE_KEY.fullmatch(k) else json.dumps(k)} = {toml_value(v)}"
                 for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"no TOML form for {value!r}")


def listing() -> str:
    """Every key as ``key = default  # meaning``: a TOML file of the defaults."""
    defaults = Config()
    meanings = key_meanings()
    pairs = [f"{key} = {toml_value(getattr(defaults, key))}" for key in meanings]
    width = min(max(map(len, pairs)), LISTING_WIDTH)
    return "".join(f"{pair:<{width}}  # {meaning}\n"
                   for pair, meaning in zip(pairs, meanings.values(), strict=True))


def examples() -> dict[str, str]:
    """Example name -> the text of ``pipeline/examples/<name>.toml``."""
    folder = resources.files("rlhfless.pipeline") / "examples"
    return {item.name.removesuffix(".toml"): item.read_text(encoding="utf-8")
            for item in sorted(folder.iterdir(), key=lambda i: i.name)
            if item.name.endswith(".toml")}


def example(name: str) -> str:
    """The example ``name``; ``ConfigError`` naming the ones there are otherwise."""
    found = examples()
    if name not in found:
        raise ConfigError(f"config --example {name!r}: no such example; choose one of "
                          f"{sorted(found)}")
    return found[name]
