"""Load stage: read a prompt dataset into a ``schema.PROMPTS`` table.

    source (.parquet | .jsonl | .json | pyarrow.Table | datasets.Dataset)
        --read_prompts-->  prompts (prompt_id, prompt_ids, answer, data_source, record)

Reading the source and parsing each record (the formats accepted, where the answer and
``prompt_id`` come from, what makes a bad record) is ``ops/data/records.py``; this module renders,
tokenises and limits the prompts and builds the table. Duplicate ids are an error that names
both rows.

Chat messages are rendered with the tokenizer's chat template (``add_generation_prompt``)
and the text is encoded with ``add_special_tokens=False``: the template owns BOS and role
markers. A plain string is encoded as it is, unless ``apply_chat_template=True`` wraps it
as one user message.

Nothing is dropped silently: each record read is either a row of the table or counted in
``n_skipped_bad`` / ``n_skipped_long``, with its reason in ``skipped`` (the first
``MAX_SKIP_REASONS``), named by file and 1-based line (JSONL) or row.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import pyarrow as pa
from jinja2 import TemplateError

from . import schema
from .records import BadRow, Prompt, open_records, parse_record

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MAX_SKIP_REASONS = 100  # reasons kept in LoadResult.skipped; the counters stay exact
ENCODE_CHUNK = 1024  # texts per tokenizer call

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
    prompt_key: str = "prompt",
    answer_key: str = "",
) -> LoadResult:
    """Read ``source`` and tokenise its prompts into a ``schema.PROMPTS`` table.

    ``source`` is a path to a ``.parquet``, ``.jsonl`` or ``.json`` (JSON lines) file, a
    ``pyarrow.Table``, or a Hugging Face ``datasets.Dataset``. ``on_bad_row="error"`` raises
    ``ValueError`` at the first malformed record, ``"skip"`` counts and drops it. A prompt
    over ``max_prompt_tokens`` tokens raises (``"error"``), keeps its last tokens
    (``"truncate"``: the question and the generation prompt are at the end) or is dropped
    (``"skip"``). ``apply_chat_template``: None renders chat messages and encodes strings
    as they are; True also wraps strings as one user message; False refuses messages.
    ``require_answers`` makes a record without a ground truth a bad record. ``prompt_key``
    names the prompt's column, ``answer_key`` the ground truth's (dotted for a nested field;
    empty: the formats' own columns, ``records.py``).
    """
    _check_options(max_prompt_tokens, on_bad_row, on_long_prompt, apply_chat_template)
    if apply_chat_template:
        _require_chat_template(tokenizer, "apply_chat_template=True")
    name, stem, records = open_records(source, prompt_key)
    tally = _Tally()
    prompts: list[Prompt] = []
    first_seen: dict[str, Prompt] = {}
    n_read = 0
    render = partial(_render, tokenizer=tokenizer, apply_chat_template=apply_chat_template)
    for record in records:
        n_read += 1
        try:
            prompt = parse_record(record, stem, render, require_answers, prompt_key, answer_key)
        except BadRow as err:
            if on_bad_row == "error":
                raise BadRow(f"{record.where}: {err}; pass on_bad_row='skip' to skip it") from None
            tally.n_bad += 1
            tally.note(f"{record.where}: {err}")
            continue
        _check_unique(prompt, first_seen)
        prompts.append(prompt)
    kept: list[tuple[Prompt, list[int]]] = []
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


# -- prompts ----------------------------------------------------------------------------


def _render(
    prompt: str | list[dict],
    where: str,
    tokenizer: PreTrainedTokenizerBase,
    apply_chat_template: bool | None,
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


def _check_unique(prompt: Prompt, first_seen: dict[str, Prompt]) -> None:
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


def _to_table(rows: list[tuple[Prompt, list[int]]], name: str) -> pa.Table:
    """The kept rows as a table conforming to ``schema.PROMPTS``."""
    table = pa.table(
        {
            "prompt_id": pa.array([p.prompt_id for p, _ in rows], pa.string()),
            "prompt_ids": pa.array([ids for _, ids in rows], pa.list_(pa.int32())),
            "answer": pa.array([p.answer for p, _ in rows], pa.string()),
            "data_source": pa.array([p.data_source for p, _ in rows], pa.string()),
            "record": pa.array([p.record for p, _ in rows], pa.string()),  # the whole record
        }
    )
    return schema.conform(table, schema.PROMPTS, f"load {name}")
