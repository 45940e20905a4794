"""Property tests over configurations: any key and value either makes a valid ``Config``
or one ``ConfigError`` line naming the key; an accepted config survives the JSON round trip
that ``--resume`` relies on."""

from __future__ import annotations

import dataclasses
import json
import math
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


@settings(max_examples=200, deadline=None)
@given(item=st.text(max_size=30))
def test_any_override_string_is_a_config_or_one_line(item):
    try:
        load_config(None, [item])
    except ConfigError as err:
        assert "\n" not in str(err) and str(err).strip()


@settings(max_examples=150, deadline=None)
@given(values=st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=4))
def test_accepted_configs_survive_the_json_round_trip(values):
    try:
        cfg = make_config(values)
    except ConfigError:
        return
    saved = json.loads(json.dumps(cfg.to_dict()))  # what config.json holds
    assert make_config(saved) == cfg
    assert load_config(None, [], base=saved) == cfg
