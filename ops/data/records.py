"""Records: read a prompt source into records and parse each record into a ``Prompt``.

A record is one item of a source: a row of a Parquet file, an Arrow table, a Hugging Face
``datasets.Dataset`` or a pandas ``DataFrame``, or a non-blank line of a ``.jsonl`` /
``.json`` file (JSON lines, one object per line). ``open_records`` opens any of these and
yields each record with ``where``, the file and 1-based line (JSONL) or row that messages
name. Columns are read as the common RL post-training formats write them:

- veRL parquet: ``prompt`` is a list of chat messages ``[{"role", "content"}]``, the ground
  truth is ``reward_model.ground_truth``, ``data_source`` names the task and
  ``extra_info.index`` numbers the row;
- TRL: ``prompt`` is a string or chat messages, the ground truth ``answer`` or ``solution``;
- ours: ``prompt`` string, ``answer``, optional ``prompt_id`` and ``data_source``.

The answer is the first of ``reward_model.ground_truth``, ``answer``, ``solution`` that the
row has; numbers become strings, null stays null. ``prompt_id`` comes from a ``prompt_id``
or ``id`` field (integers become strings), else ``extra_info.index``, else ``<stem>:<i>``
with ``<stem>`` the file name without suffix (``table``/``dataset``/``frame`` for in-memory
sources)
and ``<i>`` the 0-based position of the record, bad records included, so an id does not
change with ``on_bad_row``.

The whole record travels with its prompt: ``record`` is the record as JSON text (every field,
nested ones as they are; values JSON cannot hold, such as dates, as their ``str``), which the
reward stage and multi-turn environments read back as a dict (``record_fields``).

A bad record makes ``parse_record`` raise ``BadRow``: a JSONL line that is not UTF-8 or not
JSON, a record that is not an object, a ``prompt`` that is missing, blank or not well-formed
chat messages, a ground truth, ``data_source`` or id of the wrong type, no ground truth when
answers are required, text with an unpaired surrogate, or messages that the chat template
(the caller's ``render``) rejects. A source that cannot be read at all (unsupported suffix,
missing file, unreadable Parquet, no ``prompt`` column, not a source) raises ``ValueError``,
``FileNotFoundError`` or ``TypeError`` instead, whatever ``on_bad_row`` says.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

SUFFIXES = (".parquet", ".jsonl", ".json")
PROMPT_ALLOWED = (
    "a non-empty string or a non-empty list of chat messages {'role': str, 'content': str}"
)
ANSWER_KEYS = ("answer", "solution")  # after reward_model.ground_truth, first present wins
ID_KEYS = ("prompt_id", "id")  # before extra_info.index
UNICODE_KEYS = ("prompt", "answer", "data_source", "prompt_id")


class BadRow(ValueError):
    """A record that cannot become a prompt; ``on_bad_row`` decides whether it is fatal."""


@dataclass(frozen=True)
class Record:
    """One item of a source, decoded or with the reason it could not be."""

    where: str  # "data.jsonl:line 3" or "data.parquet:row 3", 1-based
    index: int  # 0-based position among the source's records
    row: Any  # the decoded record; None when ``error`` is set
    error: str | None = None  # why the record could not be decoded at all


@dataclass(frozen=True)
class Prompt:
    """A valid record: its prompt text, ground truth, task and id, ready to be tokenised."""

    where: str
    prompt_id: str
    id_from: str  # the field the id came from, for the duplicate-id message
    text: str  # what is encoded: the prompt, or its chat-template rendering
    answer: str | None
    data_source: str | None
    record: str  # the whole record as JSON text


# -- sources ----------------------------------------------------------------------------


def open_records(source: Any, prompt_key: str = "prompt") -> tuple[str, str, Iterator[Record]]:
    """Return (name for messages, stem for default ids, records) of any accepted source; a
    table (Parquet, in memory) must have the ``prompt_key`` column."""
    if isinstance(source, (str, os.PathLike)):
        return _open_path(Path(source), prompt_key)
    name, stem, table = in_memory_table(source)
    return name, stem, _table_records(table, name, prompt_key)


def in_memory_table(source: Any) -> tuple[str, str, pa.Table]:
    """(name for messages, stem for default ids, Arrow table) of an in-memory source: a
    ``pyarrow.Table``, a ``datasets.Dataset`` or a pandas ``DataFrame`` (its index is not a
    column); ``TypeError`` naming what is allowed for anything else."""
    if isinstance(source, pa.Table):
        return "<table>", "table", source
    if isinstance(source, Mapping):
        raise TypeError(
            "got a mapping of splits (a datasets.DatasetDict?); pass one split, e.g. ds['train']"
        )
    if _is_data_frame(source):
        try:
            return "<frame>", "frame", pa.Table.from_pandas(source, preserve_index=False)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as err:  # a column of mixed types
            raise TypeError(f"cannot read prompts from this DataFrame: {err}") from None
    table = _dataset_table(source)
    if table is None:
        raise TypeError(
            f"cannot read prompts from a {type(source).__name__}; allowed: a path to a "
            f"{', '.join(SUFFIXES)} file, a pyarrow.Table, a datasets.Dataset or a "
            "pandas.DataFrame"
        )
    return "<dataset>", "dataset", table


def _is_data_frame(source: Any) -> bool:
    """Whether ``source`` is a pandas ``DataFrame`` (one exists only once pandas is imported,
    so pandas is not imported for the check)."""
    pandas = sys.modules.get("pandas")
    return pandas is not None and isinstance(source, pandas.DataFrame)


def _open_path(path: Path, prompt_key: str) -> tuple[str, str, Iterator[Record]]:
    """Check the suffix and existence of ``path`` and return its records."""
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(
            f"{path}: unsupported file type {path.suffix or '(none)'!r}; "
            "allowed: .parquet, .jsonl, .json (JSON lines)"
        )
    if not path.exists():
        raise FileNotFoundError(f"prompt file not found: {path}")
    if suffix == ".parquet":
        try:
            table = pq.read_table(path)
        except (pa.ArrowInvalid, OSError) as err:
            raise ValueError(f"{path}: cannot read as Parquet: {err}") from err
        return str(path), path.stem, _table_records(table, str(path), prompt_key)
    return str(path), path.stem, _jsonl_records(path)


def _dataset_table(source: Any) -> pa.Table | None:
    """The Arrow table of a ``datasets.Dataset``-like object, or None if it is not one.

    ``with_format("arrow")[:]`` comes first because it applies the index mapping that
    ``select``/``shuffle``/``filter`` leave on a Dataset; ``data.table`` is the raw table.
    """
    with_format = getattr(source, "with_format", None)
    if callable(with_format):
        table = with_format("arrow")[:]
        if isinstance(table, pa.Table):
            return table
    table = getattr(getattr(source, "data", None), "table", None)
    return table if isinstance(table, pa.Table) else None


def _table_records(table: pa.Table, name: str, prompt_key: str) -> Iterator[Record]:
    """One record per row of ``table``; a table without a ``prompt_key`` column is an error."""
    if prompt_key not in table.column_names:
        raise ValueError(
            f"{name}: no {prompt_key!r} column (columns: {table.column_names}); the prompt "
            f"must be in that column, as {PROMPT_ALLOWED}, or set prompt_key to the column "
            "that has it"
        )
    index = 0
    for batch in table.to_batches():
        for row in batch.to_pylist():
            yield Record(f"{name}:row {index + 1}", index, row)
            index += 1


def _jsonl_records(path: Path) -> Iterator[Record]:
    """One record per non-blank line of ``path``, decoded line by line so that a bad line
    (invalid UTF-8, broken JSON) is one bad record named by its line number."""
    index = 0
    for lineno, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        if lineno == 1:
            raw = raw.removeprefix(b"\xef\xbb\xbf")  # UTF-8 byte order mark
        if not raw.strip():
            continue
        row, error = _decode_line(raw)
        yield Record(f"{path}:line {lineno}", index, row, error)
        index += 1


def _decode_line(raw: bytes) -> tuple[Any, str | None]:
    """(value, None) for a line holding JSON, else (None, why)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, (
            f"not valid UTF-8 (byte 0x{raw[err.start]:02x} at byte {err.start + 1}); "
            "expected UTF-8 encoded text"
        )
    try:
        return json.loads(text), None
    except json.JSONDecodeError as err:
        why = f"not valid JSON ({err.msg} at column {err.colno})"
        return None, f"{why}; expected one JSON object per line"


# -- records ----------------------------------------------------------------------------


def parse_record(
    record: Record,
    stem: str,
    render: Callable[[str | list[dict], str], str],
    require_answers: bool = False,
    prompt_key: str = "prompt",
    answer_key: str = "",
) -> Prompt:
    """Validate one record and make its prompt text with ``render(prompt, where)``, which
    may raise ``BadRow`` too; ``BadRow`` says what is wrong. The prompt is the
    ``prompt_key`` field; the ground truth the ``answer_key`` field (dots reach into nested
    ones: ``extra_info.answer``) if given, else the first of ``ANSWER_KEYS``' order."""
    if record.error is not None:
        raise BadRow(record.error)
    row = record.row
    if not isinstance(row, dict):
        raise BadRow(f"record is {_kind(row)}; expected an object with a {prompt_key!r} field")
    prompt = _parse_prompt(row, prompt_key)
    answer = _parse_answer(row, answer_key)
    if require_answers and not answer:
        where = repr(answer_key) if answer_key else \
            "'reward_model.ground_truth', 'answer' or 'solution'; or set answer_key"
        raise BadRow(f"no ground truth ({where}); set require_answers = false if the reward "
                     "needs none")
    data_source = row.get("data_source")
    if data_source is not None and not isinstance(data_source, str):
        raise BadRow(f"'data_source' is {_kind(data_source)}; expected a string or null")
    prompt_id, id_from = _parse_prompt_id(row, stem, record.index)
    text = render(prompt, record.where)
    for key, value in zip(UNICODE_KEYS, (text, answer, data_source, prompt_id), strict=True):
        _require_unicode(value, key)
    return Prompt(record.where, prompt_id, id_from, text, answer, data_source,
                  json.dumps(row, default=str))


def record_fields(row: dict) -> dict:
    """The fields of a table row's source record (its ``record`` column, decoded), under the
    row's own columns; a row without ``record`` is returned as it is."""
    text = row.get("record")
    fields = json.loads(text) if isinstance(text, str) else {}
    return fields | {k: v for k, v in row.items() if k != "record"}


def _parse_prompt(row: dict, key: str) -> str | list[dict]:
    """The record's prompt, field ``key``: a non-blank string or a list of well-formed chat
    messages."""
    if key not in row:
        raise BadRow(f"no {key!r} field; expected {PROMPT_ALLOWED}")
    prompt = row[key]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadRow(f"{key!r} is empty; expected {PROMPT_ALLOWED}")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise BadRow(f"{key!r} is an empty list; expected {PROMPT_ALLOWED}")
        return [_parse_message(message, i) for i, message in enumerate(prompt)]
    raise BadRow(f"{key!r} is {_kind(prompt)}; expected {PROMPT_ALLOWED}")


def _parse_message(message: Any, i: int) -> dict:
    """A chat message with string ``role`` and ``content``; null fields (from Arrow structs
    that unify several message shapes) are dropped."""
    if not isinstance(message, dict):
        raise BadRow(f"prompt message {i} is {_kind(message)}; expected {PROMPT_ALLOWED}")
    for key in ("role", "content"):
        if not isinstance(message.get(key), str):
            raise BadRow(
                f"prompt message {i} has {key!r} {_kind(message.get(key))}; "
                f"expected {PROMPT_ALLOWED}"
            )
    if not message["role"]:
        raise BadRow(f"prompt message {i} has an empty 'role'; expected {PROMPT_ALLOWED}")
    return {key: value for key, value in message.items() if value is not None}


def _parse_answer(row: dict, answer_key: str) -> str | None:
    """The ground truth as a string (numbers are formatted), or None if the row has none."""
    key, value = (answer_key, _field(row, answer_key)) if answer_key else _find_answer(row)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise BadRow(f"{key!r} is {value}; expected a string, a finite number or null")
        return str(value)
    raise BadRow(f"{key!r} is {_kind(value)}; expected a string, a number or null")


def _field(row: dict, path: str) -> Any:
    """The value at the dotted ``path`` of ``row`` (``extra_info.answer``), None if absent."""
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _find_answer(row: dict) -> tuple[str, Any]:
    """(field name, raw value) of the row's ground truth; (``"answer"``, None) if absent."""
    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict) and "ground_truth" in reward_model:
        return "reward_model.ground_truth", reward_model["ground_truth"]
    if reward_model is not None and not isinstance(reward_model, dict):
        raise BadRow(
            f"'reward_model' is {_kind(reward_model)}; expected an object with 'ground_truth'"
        )
    for key in ANSWER_KEYS:
        if key in row:
            return key, row[key]
    return "answer", None


def _parse_prompt_id(row: dict, stem: str, index: int) -> tuple[str, str]:
    """(prompt_id, the field it came from) for a record at 0-based ``index``."""
    for key in ID_KEYS:
        if key in row:
            return _id_text(row[key], repr(key)), repr(key)
    extra_info = row.get("extra_info")
    if isinstance(extra_info, dict) and extra_info.get("index") is not None:
        return _id_text(extra_info["index"], "'extra_info.index'"), "'extra_info.index'"
    return f"{stem}:{index}", "the record position"


def _id_text(value: Any, key: str) -> str:
    """An id field as a string: a non-empty string as it is, an integer in decimal."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    shown = "an empty string" if value == "" else _kind(value)
    raise BadRow(f"{key} is {shown}; expected a non-empty string or an integer")


def _require_unicode(value: str | None, key: str) -> None:
    """Raise ``BadRow`` if ``value`` holds a lone surrogate (a JSON escape such as
    ``\\ud800``), which neither the tokenizer nor Arrow can take."""
    if value is None:
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise BadRow(
            f"{key!r} holds an unpaired surrogate {value[err.start]!r} at character "
            f"{err.start + 1}; expected valid Unicode text"
        ) from None


def _kind(value: Any) -> str:
    """A short description of a value's type for messages: ``an int (3)``, ``null``."""
    if value is None:
        return "null"
    name = type(value).__name__
    article = "an" if name[0] in "aeiou" else "a"
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
    return f"{article} {name} ({shown})"
