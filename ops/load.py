"""Load stage: read a prompt dataset into a ``schema.PROMPTS`` table.

    source (.parquet | .jsonl | .json | pyarrow.Table | datasets.Dataset)
        --read_prompts-->  prompts (prompt_id, prompt_ids, answer, data_source)

A ``.json`` file is read as JSON lines, one object per line. Columns are read as the
common RL post-training formats write them:

- veRL parquet: ``prompt`` is a list of chat messages ``[{"role", "content"}]``, the ground
  truth is ``reward_model.ground_truth``, ``data_source`` names the task and
  ``extra_info.index`` numbers the row;
- TRL: ``prompt`` is a string or chat messages, the ground truth ``answer`` or ``solution``;
- ours: ``prompt`` string, ``answer``, optional ``prompt_id`` and ``data_source``.

The answer is the first of ``reward_model.ground_truth``, ``answer``, ``solution`` that the
row has; numbers become strings, null stays null. ``prompt_id`` comes from a ``prompt_id``
or ``id`` field (integers become strings), else ``extra_info.index``, else ``<stem>:<i>``
with ``<stem>`` the file name without suffix (``table``/``dataset`` for in-memory sources)
and ``<i>`` the 0-based position of the record, bad records included, so an id does not
change with ``on_bad_row``. Duplicate ids are an error that names both rows.

Chat messages are rendered with the tokenizer's chat template (``add_generation_prompt``)
and the text is encoded with ``add_special_tokens=False``: the template owns BOS and role
markers. A plain string is encoded as it is, unless ``apply_chat_template=True`` wraps it
as one user message.

Nothing is dropped silently: each record read is either a row of the table or counted in
``n_skipped_bad`` / ``n_skipped_long``, with its reason in ``skipped`` (the first
``MAX_SKIP_REASONS``). Messages name the file and the 1-based line (JSONL) or row.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from jinja2 import TemplateError

from . import schema

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SUFFIXES = (".parquet", ".jsonl", ".json")
MAX_SKIP_REASONS = 100  # reasons kept in LoadResult.skipped; the counters stay exact
ENCODE_CHUNK = 1024  # texts per tokenizer call
PROMPT_ALLOWED = (
    "a non-empty string or a non-empty list of chat messages {'role': str, 'content': str}"
)
ANSWER_KEYS = ("answer", "solution")  # after reward_model.ground_truth, first present wins
ID_KEYS = ("prompt_id", "id")  # before extra_info.index
UNICODE_KEYS = ("prompt", "answer", "data_source", "prompt_id")

BadRowPolicy = Literal["error", "skip"]
LongPromptPolicy = Literal["error", "truncate", "skip"]


@dataclass(frozen=True)
class LoadResult:
    """The prompts table and an account of every record that did not become a row of it."""

    table: pa.Table  # conforms to schema.PROMPTS, rows in source order
    n_rows_read: int  # records in the source (blank JSONL lines are not records)
    n_skipped_bad: int  # malformed records dropped under on_bad_row="skip"
    n_truncated: int  # rows kept with their prompt cut to the last max_prompt_tokens tokens
    n_skipped_long: int  # rows dropped under on_long_prompt="skip"
    skipped: list[str]  # "file:row N: why" for the first MAX_SKIP_REASONS dropped records


class BadRow(ValueError):
    """A record that cannot become a prompt; ``on_bad_row`` decides whether it is fatal."""


@dataclass(frozen=True)
class _Record:
    where: str  # "data.jsonl:line 3" or "data.parquet:row 3", 1-based
    index: int  # 0-based position among the source's records
    row: Any  # the decoded record; None when ``error`` is set
    error: str | None = None  # why the record could not be decoded at all


@dataclass(frozen=True)
class _Prompt:
    where: str
    prompt_id: str
    id_from: str  # the field the id came from, for the duplicate-id message
    text: str  # what is encoded: the prompt, or its chat-template rendering
    answer: str | None
    data_source: str | None


@dataclass
class _Tally:
    n_bad: int = 0
    n_truncated: int = 0
    n_long: int = 0
    reasons: list[str] = field(default_factory=list)

    def note(self, reason: str) -> None:
        if len(self.reasons) < MAX_SKIP_REASONS:
            self.reasons.append(reason)


def read_prompts(
    source: str | os.PathLike[str] | pa.Table | Any,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_prompt_tokens: int | None = None,
    on_bad_row: BadRowPolicy = "error",
    on_long_prompt: LongPromptPolicy = "skip",
    apply_chat_template: bool | None = None,
    require_answers: bool = False,
) -> LoadResult:
    """Read ``source`` and tokenise its prompts into a ``schema.PROMPTS`` table.

    ``source`` is a path to a ``.parquet``, ``.jsonl`` or ``.json`` (JSON lines) file, a
    ``pyarrow.Table``, or a Hugging Face ``datasets.Dataset``. ``on_bad_row="error"`` raises
    ``ValueError`` at the first malformed record, ``"skip"`` counts and drops it. A prompt
    over ``max_prompt_tokens`` tokens raises (``"error"``), keeps its last tokens
    (``"truncate"``: the question and the generation prompt are at the end) or is dropped
    (``"skip"``). ``apply_chat_template``: None renders chat messages and encodes strings
    as they are; True also wraps strings as one user message; False refuses messages.
    ``require_answers`` makes a record without a ground truth a bad record.
    """
    _check_options(max_prompt_tokens, on_bad_row, on_long_prompt, apply_chat_template)
    if apply_chat_template:
        _require_chat_template(tokenizer, "apply_chat_template=True")
    name, stem, records = _open_records(source)
    tally = _Tally()
    prompts: list[_Prompt] = []
    first_seen: dict[str, _Prompt] = {}
    n_read = 0
    for record in records:
        n_read += 1
        try:
            prompt = _parse_record(record, stem, tokenizer, apply_chat_template, require_answers)
        except BadRow as err:
            if on_bad_row == "error":
                raise BadRow(f"{record.where}: {err}; pass on_bad_row='skip' to skip it") from None
            tally.n_bad += 1
            tally.note(f"{record.where}: {err}")
            continue
        _check_unique(prompt, first_seen)
        prompts.append(prompt)
    kept: list[tuple[_Prompt, list[int]]] = []
    for prompt, ids in zip(prompts, _encode(tokenizer, [p.text for p in prompts]), strict=True):
        ids = _limit_length(ids, prompt.where, max_prompt_tokens, on_long_prompt, tally)
        if ids is not None:
            kept.append((prompt, ids))
    return LoadResult(
        table=_to_table(kept, name),
        n_rows_read=n_read,
        n_skipped_bad=tally.n_bad,
        n_truncated=tally.n_truncated,
        n_skipped_long=tally.n_long,
        skipped=tally.reasons,
    )


def _check_options(
    max_prompt_tokens: int | None,
    on_bad_row: str,
    on_long_prompt: str,
    apply_chat_template: bool | None,
) -> None:
    """Raise ``ValueError`` naming the first option of ``read_prompts`` that is not allowed."""
    if on_bad_row not in ("error", "skip"):
        raise ValueError(f"on_bad_row={on_bad_row!r}; allowed: 'error', 'skip'")
    if on_long_prompt not in ("error", "truncate", "skip"):
        raise ValueError(f"on_long_prompt={on_long_prompt!r}; allowed: 'error', 'truncate', 'skip'")
    limit = max_prompt_tokens
    if limit is not None and (type(limit) is not int or limit < 1):  # bool is not a limit
        raise ValueError(f"max_prompt_tokens={max_prompt_tokens!r}; allowed: None or an int >= 1")
    if apply_chat_template not in (None, True, False):
        raise ValueError(f"apply_chat_template={apply_chat_template!r}; allowed: None, True, False")


def _require_chat_template(tokenizer: PreTrainedTokenizerBase, why: str) -> None:
    """Raise ``ValueError`` if ``tokenizer`` has no chat template though ``why`` needs one."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"{why}, but the tokenizer has no chat_template; set tokenizer.chat_template "
            "or give prompts as plain strings with apply_chat_template=None"
        )


# -- sources ----------------------------------------------------------------------------


def _open_records(source: Any) -> tuple[str, str, Iterator[_Record]]:
    """Return (name for messages, stem for default ids, records) of any accepted source."""
    if isinstance(source, (str, os.PathLike)):
        return _open_path(Path(source))
    if isinstance(source, pa.Table):
        return "<table>", "table", _table_records(source, "<table>")
    if isinstance(source, Mapping):
        raise TypeError(
            "got a mapping of splits (a datasets.DatasetDict?); pass one split, e.g. ds['train']"
        )
    table = _dataset_table(source)
    if table is None:
        raise TypeError(
            f"cannot read prompts from a {type(source).__name__}; allowed: a path to a "
            f"{', '.join(SUFFIXES)} file, a pyarrow.Table or a datasets.Dataset"
        )
    return "<dataset>", "dataset", _table_records(table, "<dataset>")


def _open_path(path: Path) -> tuple[str, str, Iterator[_Record]]:
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
        return str(path), path.stem, _table_records(table, str(path))
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


def _table_records(table: pa.Table, name: str) -> Iterator[_Record]:
    """One record per row of ``table``; a table without a ``prompt`` column is an error."""
    if "prompt" not in table.column_names:
        raise ValueError(
            f"{name}: no 'prompt' column (columns: {table.column_names}); the prompt must be "
            f"in a column named 'prompt', as {PROMPT_ALLOWED}"
        )
    index = 0
    for batch in table.to_batches():
        for row in batch.to_pylist():
            yield _Record(f"{name}:row {index + 1}", index, row)
            index += 1


def _jsonl_records(path: Path) -> Iterator[_Record]:
    """One record per non-blank line of ``path``, decoded line by line so that a bad line
    (invalid UTF-8, broken JSON) is one bad record named by its line number."""
    index = 0
    for lineno, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        if lineno == 1:
            raw = raw.removeprefix(b"\xef\xbb\xbf")  # UTF-8 byte order mark
        if not raw.strip():
            continue
        row, error = _decode_line(raw)
        yield _Record(f"{path}:line {lineno}", index, row, error)
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


def _parse_record(
    record: _Record,
    stem: str,
    tokenizer: PreTrainedTokenizerBase,
    apply_chat_template: bool | None,
    require_answers: bool = False,
) -> _Prompt:
    """Validate one record and render its prompt text; ``BadRow`` says what is wrong."""
    if record.error is not None:
        raise BadRow(record.error)
    row = record.row
    if not isinstance(row, dict):
        raise BadRow(f"record is {_kind(row)}; expected an object with a 'prompt' field")
    prompt = _parse_prompt(row)
    answer = _parse_answer(row)
    if require_answers and not answer:
        raise BadRow("no ground truth ('reward_model.ground_truth', 'answer' or 'solution'); "
                     "set require_answers = false if the reward needs none")
    data_source = row.get("data_source")
    if data_source is not None and not isinstance(data_source, str):
        raise BadRow(f"'data_source' is {_kind(data_source)}; expected a string or null")
    prompt_id, id_from = _parse_prompt_id(row, stem, record.index)
    text = _render(prompt, tokenizer, apply_chat_template, record.where)
    for key, value in zip(UNICODE_KEYS, (text, answer, data_source, prompt_id), strict=True):
        _require_unicode(value, key)
    return _Prompt(record.where, prompt_id, id_from, text, answer, data_source)


def _parse_prompt(row: dict) -> str | list[dict]:
    """The record's prompt: a non-blank string or a list of well-formed chat messages."""
    if "prompt" not in row:
        raise BadRow(f"no 'prompt' field; expected {PROMPT_ALLOWED}")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadRow(f"'prompt' is empty; expected {PROMPT_ALLOWED}")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise BadRow(f"'prompt' is an empty list; expected {PROMPT_ALLOWED}")
        return [_parse_message(message, i) for i, message in enumerate(prompt)]
    raise BadRow(f"'prompt' is {_kind(prompt)}; expected {PROMPT_ALLOWED}")


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


def _parse_answer(row: dict) -> str | None:
    """The ground truth as a string (numbers are formatted), or None if the row has none."""
    key, value = _find_answer(row)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise BadRow(f"{key!r} is {value}; expected a string, a finite number or null")
        return str(value)
    raise BadRow(f"{key!r} is {_kind(value)}; expected a string, a number or null")


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


def _render(
    prompt: str | list[dict],
    tokenizer: PreTrainedTokenizerBase,
    apply_chat_template: bool | None,
    where: str,
) -> str:
    """The text to encode: a plain prompt as it is, messages through the chat template.

    A template that rejects the messages (``raise_exception``, e.g. roles that do not
    alternate) makes the record bad; a template or tokenizer that is missing or broken is
    an error whatever ``on_bad_row`` says, since it would reject every record.
    """
    if isinstance(prompt, str) and not apply_chat_template:
        return prompt
    if apply_chat_template is False:
        raise ValueError(
            f"{where}: 'prompt' is a list of chat messages but apply_chat_template=False; "
            "pass apply_chat_template=None to render messages with the chat template"
        )
    _require_chat_template(tokenizer, f"{where}: 'prompt' needs the chat template")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError as err:
        raise BadRow(f"the chat template rejects the messages: {err}") from err


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


def _check_unique(prompt: _Prompt, first_seen: dict[str, _Prompt]) -> None:
    """Raise ``ValueError`` naming both rows if ``prompt``'s id was already seen."""
    earlier = first_seen.setdefault(prompt.prompt_id, prompt)
    if earlier is not prompt:
        raise ValueError(
            f"duplicate prompt_id {prompt.prompt_id!r}: {earlier.where} (from {earlier.id_from})"
            f" and {prompt.where} (from {prompt.id_from}); prompt ids must be unique"
        )


# -- tokens -----------------------------------------------------------------------------


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens added (the template owns them)."""
    ids: list[list[int]] = []
    for start in range(0, len(texts), ENCODE_CHUNK):
        ids += tokenizer(texts[start : start + ENCODE_CHUNK], add_special_tokens=False)["input_ids"]
    return ids


def _limit_length(
    ids: list[int], where: str, limit: int | None, policy: str, tally: _Tally
) -> list[int] | None:
    """``ids`` within ``limit`` tokens under ``policy``; None when the row is skipped."""
    if limit is None or len(ids) <= limit:
        return ids
    if policy == "truncate":
        tally.n_truncated += 1
        return ids[-limit:]
    if policy == "skip":
        tally.n_long += 1
        tally.note(f"{where}: prompt is {len(ids)} tokens, over max_prompt_tokens={limit}")
        return None
    raise ValueError(
        f"{where}: prompt is {len(ids)} tokens, over max_prompt_tokens={limit}; pass "
        f"on_long_prompt='truncate' (keep the last {limit} tokens) or 'skip', or raise the limit"
    )


def _to_table(rows: list[tuple[_Prompt, list[int]]], name: str) -> pa.Table:
    """The kept rows as a table conforming to ``schema.PROMPTS``."""
    table = pa.table(
        {
            "prompt_id": pa.array([p.prompt_id for p, _ in rows], pa.string()),
            "prompt_ids": pa.array([ids for _, ids in rows], pa.list_(pa.int32())),
            "answer": pa.array([p.answer for p, _ in rows], pa.string()),
            "data_source": pa.array([p.data_source for p, _ in rows], pa.string()),
        }
    )
    return schema.conform(table, schema.PROMPTS, f"load {name}")
