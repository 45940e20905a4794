"""Property tests over configurations: any key and value either makes a valid ``Config``
or one ``ConfigError`` line naming the key; an accepted config survives the JSON round trip
that ``--resume`` relies on."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from typing import get_type_hints

from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfless.pipeline.config import CHOICES, Config, ConfigError, load_config, make_config

KEYS = sorted(f.name for f in dataclasses.fields(Config))
SCALARS = (st.integers(-10**6, 10**6) | st.floats(allow_nan=True, allow_infinity=True)
           | st.booleans() | st.text(max_size=12))
VALUES = SCALARS | st.lists(st.text(max_size=6), max_size=3) | st.dictionaries(
    st.text(min_size=1, max_size=6), st.integers(-3, 3) | st.floats() | st.text(max_size=6)
    | st.booleans(), max_size=3)


def check_rejection(err: ConfigError, key: str) -> None:
    message = str(err)
    assert "\n" not in message and message.strip(), message
    assert key in message or repr(key) in message, (key, message)


def finite_floats(cfg: Config) -> bool:
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        numbers = value.values() if isinstance(value, dict) else [value]
        if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
            return False
    return True


@settings(max_examples=400, deadline=None)
@given(key=st.sampled_from(KEYS) | st.text(min_size=1, max_size=10), value=VALUES)
def test_any_key_and_value_is_a_config_or_one_line_naming_it(key, value):
    try:
        cfg = make_config({key: value})
    except ConfigError as err:
        check_rejection(err, key)
        return
    assert key in KEYS
    assert finite_floats(cfg), (key, value)


HINTS = get_type_hints(Config)


def typed_values(key: str) -> st.SearchStrategy:
    """Values of the key's own type, edge cases included (NaN, inf, empty, negative)."""
    kind = HINTS[key]
    if kind is float:
        return st.floats(allow_nan=True, allow_infinity=True) | st.integers(-5, 5)
    if kind is int:
        return st.integers(-3, 100)
    if kind is bool:
        return st.booleans()
    if kind is str:
        return st.text(max_size=8) | st.sampled_from(
            [v for choices in CHOICES.values() for v in choices])
    return VALUES


@settings(max_examples=400, deadline=None)
@given(data=st.data(), key=st.sampled_from(KEYS))
def test_typed_values_are_a_config_or_one_line_naming_the_key(data, key):
    value = data.draw(typed_values(key))
    try:
        cfg = make_config({key: value})
    except ConfigError as err:
        check_rejection(err, key)
        return
    assert finite_floats(cfg), (key, value)


DEFAULTS = Config()
FLOAT_VALUES = {"top_p": 0.5, "kl_coef": 0.1, "tis_cap": 3.0, "replay_ratio": 0.25,
                "max_wall_s": 60.0, "reward_fallback": -1.0, "job_start_timeout_s": 30.0}
TEXT_VALUES = {"name": "run-2.b", "runs_dir": "out", "walltime": "02:00:00",
               "worker_lifetime": "30m", "environment": "python", "interface": "ib0",
               "scheduler_host": "10.0.0.1", "queue": "short", "account": "proj"}


def valid_values(key: str) -> st.SearchStrategy:
    """Values in the key's own valid range that differ from its default (choices, a larger
    count, a float inside its interval, a flipped switch); keys with no such value keep it."""
    default = getattr(DEFAULTS, key)
    if key in CHOICES:
        return st.sampled_from([c for c in CHOICES[key] if c != default])
    if isinstance(default, bool):
        return st.just(not default)
    if isinstance(default, int):
        return st.integers(default + 1, default + 4)
    if isinstance(default, float):
        return st.just(FLOAT_VALUES.get(key, default * 2 if default > 0 else default))
    if key in TEXT_VALUES:
        return st.just(TEXT_VALUES[key])
    return st.just(default)


@st.composite
def valid_configs(draw) -> dict:
    keys = draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    return {key: draw(valid_values(key)) for key in keys}


def toml_literal(value) -> str:
    """``value`` as a TOML value (JSON's spelling of strings, numbers, booleans and lists of
    strings is TOML's; a table is written inline)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {toml_literal(v)}"
                               for k, v in value.items()) + "}"
    return json.dumps(value)


TOML_VALUES = ["1", "-3", "0.5", "1e-3", "nan", "-inf", "true", "false", "'text'", '"x"',
               "[1, 2]", "['a']", "{a = 1}", "{}", "2024-01-01", "'unclosed"]


@st.composite
def overrides(draw) -> str:
    """``key=value`` with a key of the config and, as often as not, a valid value of it,
    else a TOML value or any text; spaces around ``=`` or not."""
    key = draw(st.sampled_from(KEYS))
    if draw(st.booleans()):
        value = toml_literal(draw(valid_values(key)))
    else:
        value = draw(st.sampled_from(TOML_VALUES) | st.text(max_size=12))
    return key + draw(st.sampled_from(["=", " = ", "= ", " ="])) + value


def test_any_override_string_is_a_config_or_one_line():
    """``key=value`` strings (a key of the config or not) and any text at all: a config, or
    one line that names the key of a ``key=value``."""
    outcomes = []

    @settings(max_examples=300, deadline=None, database=None)
    @given(item=overrides() | st.builds("{}={}".format, st.text(max_size=8),
                                        st.text(max_size=12)) | st.text(max_size=30))
    def override(item):
        try:
            cfg = load_config(None, [item])
        except ConfigError as err:
            assert "\n" not in str(err) and str(err).strip()
            if "=" in item:
                check_rejection(err, item.split("=", 1)[0].strip())
            outcomes.append("rejected")
            return
        outcomes.append("accepted" if cfg != DEFAULTS else "default")

    override()
    # both ends of a key=value reached: values taken, keys or values refused
    assert outcomes.count("accepted") >= 10 and outcomes.count("rejected") >= 30, (
        Counter(outcomes))


def test_accepted_configs_survive_the_json_round_trip():
    outcomes = []

    @settings(max_examples=150, deadline=None, database=None)
    @given(values=valid_configs())
    def round_trip(values):
        try:
            cfg = make_config(values)
        except ConfigError as err:
            assert "\n" not in str(err) and str(err).strip()
            outcomes.append(False)
            return
        outcomes.append(cfg != DEFAULTS)
        saved = json.loads(json.dumps(cfg.to_dict()))  # what config.json holds
        assert make_config(saved) == cfg
        assert load_config(None, [], base=saved) == cfg

    round_trip()
    # values in their own ranges: only cross-key rules (vllm with LoRA, replay with
    # async ...) reject a combination: about 80 % are accepted, non-default configs
    accepted = sum(outcomes)
    assert len(outcomes) >= 100 and accepted >= 0.6 * len(outcomes), (accepted, len(outcomes))
