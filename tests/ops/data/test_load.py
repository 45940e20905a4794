"""Tests of the load stage: real Parquet and JSONL files, a real (tiny, trained here) BPE
tokenizer with a chat template, every kind of bad record, and the row accounting."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rlhfless.ops.data import schema
from rlhfless.ops.data.load import MAX_SKIP_REASONS, BadRow, LoadResult, read_prompts
from rlhfless.ops.data.records import record_fields

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
USER_ONLY_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] != 'user' %}"
    "{{ raise_exception('only user messages are supported') }}{% endif %}"
    "{{ m['content'] }}\n{% endfor %}"
)


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    """A byte-level BPE of ~300 tokens trained on synthetic arithmetic chat lines."""
    lines = [
        f"<|system|>be brief\n<|user|>what is {i} plus {i * 7 % 13}?\n<|assistant|>{i + i * 7 % 13}"
        for i in range(200)
    ]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<unk>", "<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    return tok


def wrap(bpe: Tokenizer, chat_template: str | None) -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
    )
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer(bpe: Tokenizer) -> PreTrainedTokenizerFast:
    return wrap(bpe, CHAT_TEMPLATE)


def encoded(tokenizer: PreTrainedTokenizerFast, prompt: str | list[dict]) -> list[int]:
    """What the load stage should produce for ``prompt``, computed independently."""
    if isinstance(prompt, list):
        prompt = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def write_jsonl(path: Path, rows: list[dict | bytes]) -> Path:
    """One line per row: dicts as JSON, bytes written as they are (for broken lines)."""
    path.write_bytes(b"".join(as_line(row) + b"\n" for row in rows))
    return path


def as_line(row: dict | bytes) -> bytes:
    return row if isinstance(row, bytes) else json.dumps(row).encode()


def column(result: LoadResult, name: str) -> list:
    return result.table.column(name).to_pylist()


# -- formats ----------------------------------------------------------------------------


def test_verl_parquet_round_trip(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    chats = [
        [{"role": "user", "content": "what is 2 plus 3?"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 9?"}],
    ]
    table = pa.table(
        {
            "data_source": ["openai/gsm8k", "lighteval/MATH"],
            "prompt": chats,
            "ability": ["math", "math"],
            "reward_model": [
                {"style": "rule", "ground_truth": "5"},
                {"style": "rule", "ground_truth": "9"},
            ],
            "extra_info": [{"split": "train", "index": 7}, {"split": "train", "index": 8}],
        }
    )
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)

    result = read_prompts(path, tokenizer)

    assert result.table.select(schema.PROMPTS.names).schema == schema.PROMPTS
    assert column(result, "prompt_id") == ["7", "8"]
    # the whole record travels with the prompt, nested fields as they are
    records = [record_fields({"record": r}) for r in column(result, "record")]
    assert [r["extra_info"] for r in records] == table.column("extra_info").to_pylist()
    assert [r["reward_model"] for r in records] == table.column("reward_model").to_pylist()
    assert [r["ability"] for r in records] == ["math", "math"]
    assert column(result, "prompt_ids") == [encoded(tokenizer, chat) for chat in chats]
    assert column(result, "answer") == ["5", "9"]
    assert column(result, "data_source") == ["openai/gsm8k", "lighteval/MATH"]
    assert (result.n_rows_read, result.n_skipped_bad, result.n_skipped_long) == (2, 0, 0)
    rendered = tokenizer.decode(column(result, "prompt_ids")[1])
    assert rendered == "<|system|>be brief\n<|user|>what is 9?\n<|assistant|>"


@pytest.mark.parametrize("answer_key", ["solution", "answer"])
def test_trl_jsonl(tmp_path: Path, tokenizer: PreTrainedTokenizerFast, answer_key: str) -> None:
    chat = [{"role": "user", "content": "what is 4 plus 4?"}]
    path = write_jsonl(
        tmp_path / "trl.jsonl",
        [
            {"prompt": "what is 1 plus 2?", answer_key: "3"},
            {"prompt": chat, answer_key: "8"},
            {"prompt": "what is 5?", answer_key: None},
        ],
    )

    result = read_prompts(path, tokenizer)

    assert column(result, "prompt_id") == ["trl:0", "trl:1", "trl:2"]
    assert column(result, "prompt_ids") == [
        encoded(tokenizer, "what is 1 plus 2?"),
        encoded(tokenizer, chat),
        encoded(tokenizer, "what is 5?"),
    ]
    assert column(result, "answer") == ["3", "8", None]
    assert column(result, "data_source") == [None, None, None]


def test_own_format_from_table_and_json_file(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    rows = [
        {"prompt_id": "a", "prompt": "what is 6?", "answer": 6, "data_source": "tally"},
        {"prompt_id": "b", "prompt": "what is 0.5?", "answer": 0.5, "data_source": "tally"},
        {"prompt_id": 12, "prompt": "say hi", "answer": None, "data_source": None},
    ]
    from_file = read_prompts(write_jsonl(tmp_path / "own.json", rows), tokenizer)
    table = pa.table({"prompt_id": ["a", "b"], "prompt": ["x", "y"], "answer": [1, 2]})
    from_table = read_prompts(table, tokenizer)

    assert column(from_file, "prompt_id") == ["a", "b", "12"]
    assert column(from_file, "answer") == ["6", "0.5", None]
    assert column(from_file, "data_source") == ["tally", "tally", None]
    assert column(from_file, "prompt_ids")[0] == encoded(tokenizer, "what is 6?")
    assert column(from_table, "answer") == ["1", "2"]
    assert column(from_table, "prompt_ids") == [encoded(tokenizer, "x"), encoded(tokenizer, "y")]


def test_apply_chat_template_wraps_strings(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "what is 3?"}])
    result = read_prompts(path, tokenizer, apply_chat_template=True)
    chat = [{"role": "user", "content": "what is 3?"}]
    assert column(result, "prompt_ids") == [encoded(tokenizer, chat)]


def test_column_mapping_names_the_prompt_and_the_answer(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    """``prompt_key`` / ``answer_key`` (veRL's ``data.prompt_key``): another column, a dotted
    path into a nested one, and the given key wins over ``reward_model.ground_truth``."""
    rows = [{"question": "what is 2?", "extra_info": {"answer": 2},
             "reward_model": {"ground_truth": "not this"}},
            {"question": "what is 3?", "extra_info": {"answer": 3}}]
    path = write_jsonl(tmp_path / "q.jsonl", rows)
    parquet = tmp_path / "q.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    for source in (path, parquet):
        result = read_prompts(source, tokenizer, prompt_key="question",
                              answer_key="extra_info.answer", require_answers=True)
        assert column(result, "answer") == ["2", "3"]
        assert column(result, "prompt_ids") == [encoded(tokenizer, r["question"]) for r in rows]
        assert json.loads(column(result, "record")[0])["question"] == "what is 2?"
    # without the mapping the same rows are read by the formats' own columns
    assert column(read_prompts(parquet, tokenizer, prompt_key="question"), "answer")[0] == \
        "not this"
    with pytest.raises(ValueError, match="no 'prompt' column .* set prompt_key"):
        read_prompts(parquet, tokenizer)
    with pytest.raises(BadRow, match="no 'prompt' field"):
        read_prompts(path, tokenizer)
    with pytest.raises(BadRow, match=r"no ground truth \('extra_info.missing'\)"):
        read_prompts(path, tokenizer, prompt_key="question", answer_key="extra_info.missing",
                     require_answers=True)


def test_in_memory_sources(tokenizer: PreTrainedTokenizerFast) -> None:
    """A real ``datasets.Dataset`` after ``select``/``shuffle`` (an index mapping over the
    whole table) gives the rows it shows; a pandas frame's index is not a column."""
    import datasets
    import pandas as pd

    data = {"prompt": ["p0", "p1", "p2", "p3"], "answer": ["0", "1", "2", "3"]}
    full = datasets.Dataset.from_dict(data)
    assert column(read_prompts(full.select([3, 1]), tokenizer), "answer") == ["3", "1"]
    shuffled = full.shuffle(seed=0)
    assert column(read_prompts(shuffled, tokenizer), "answer") == shuffled["answer"]
    assert column(read_prompts(full, tokenizer), "prompt_id") == [f"dataset:{i}" for i in range(4)]
    frame = pd.DataFrame(data, index=[10, 11, 12, 13]).iloc[::-1]
    result = read_prompts(frame, tokenizer)
    assert column(result, "answer") == ["3", "2", "1", "0"]
    assert column(result, "prompt_id") == [f"frame:{i}" for i in range(4)]
    assert "__index_level_0__" not in json.loads(column(result, "record")[0])
    with pytest.raises(TypeError, match="splits"):
        read_prompts(datasets.DatasetDict({"train": full}), tokenizer)
    with pytest.raises(TypeError, match="cannot read prompts from this DataFrame"):
        read_prompts(pd.DataFrame({"prompt": ["a", 1]}), tokenizer)
    with pytest.raises(TypeError, match="allowed: a path .* pandas.DataFrame"):
        read_prompts([{"prompt": "p"}], tokenizer)


# -- errors that no policy skips --------------------------------------------------------


def test_duplicate_ids_name_both_rows(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    path = write_jsonl(
        tmp_path / "dup.jsonl",
        [{"id": 1, "prompt": "a"}, {"id": 2, "prompt": "b"}, {"id": "1", "prompt": "c"}],
    )
    with pytest.raises(ValueError, match="duplicate prompt_id '1'") as info:
        read_prompts(path, tokenizer, on_bad_row="skip")
    assert f"{path}:line 1" in str(info.value) and f"{path}:line 3" in str(info.value)


def test_source_errors(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    with pytest.raises(ValueError, match=r"'\.csv'; allowed: \.parquet, \.jsonl, \.json"):
        read_prompts(tmp_path / "p.csv", tokenizer)
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        read_prompts(tmp_path / "missing.parquet", tokenizer)
    pq.write_table(pa.table({"question": ["q"]}), tmp_path / "q.parquet")
    with pytest.raises(ValueError, match=r"no 'prompt' column \(columns: \['question'\]\)"):
        read_prompts(tmp_path / "q.parquet", tokenizer)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="cannot read as Parquet"):
        read_prompts(tmp_path / "junk.parquet", tokenizer)
    with pytest.raises(TypeError, match="pass one split"):
        read_prompts({"train": pa.table({"prompt": ["x"]})}, tokenizer)
    with pytest.raises(TypeError, match="cannot read prompts from a list"):
        read_prompts([{"prompt": "x"}], tokenizer)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("on_bad_row", "ignore"),
        ("on_long_prompt", "cut"),
        ("max_prompt_tokens", 0),
        ("max_prompt_tokens", True),
        ("apply_chat_template", "yes"),
    ],
)
def test_bad_options(tokenizer: PreTrainedTokenizerFast, option: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"{option}=.*allowed"):
        read_prompts(pa.table({"prompt": ["x"]}), tokenizer, **{option: value})


def test_chat_template_required(bpe: Tokenizer, tokenizer: PreTrainedTokenizerFast) -> None:
    bare = wrap(bpe, None)
    chats = pa.table({"prompt": [[{"role": "user", "content": "x"}]]})
    with pytest.raises(ValueError, match="<table>:row 1.*no chat_template"):
        read_prompts(chats, bare, on_bad_row="skip")
    with pytest.raises(ValueError, match="apply_chat_template=True.*no chat_template"):
        read_prompts(pa.table({"prompt": ["x"]}), bare, apply_chat_template=True)
    with pytest.raises(ValueError, match="row 1.*apply_chat_template=False"):
        read_prompts(chats, tokenizer, apply_chat_template=False)
    assert read_prompts(pa.table({"prompt": ["x"]}), bare).table.num_rows == 1


# -- bad records ------------------------------------------------------------------------

BAD_LINES = {
    "missing prompt": ({"answer": "1"}, "no 'prompt' field"),
    "null prompt": ({"prompt": None}, "'prompt' is null"),
    "empty prompt": ({"prompt": ""}, "'prompt' is empty"),
    "blank prompt": ({"prompt": "  \n"}, "'prompt' is empty"),
    "int prompt": ({"prompt": 7}, "'prompt' is an int (7)"),
    "empty chat": ({"prompt": []}, "'prompt' is an empty list"),
    "message not object": ({"prompt": ["hi"]}, "prompt message 0 is a str"),
    "message without content": ({"prompt": [{"role": "user"}]}, "'content' null"),
    "list answer": ({"prompt": "q", "answer": ["1", "2"]}, "'answer' is a list"),
    "bool solution": ({"prompt": "q", "solution": True}, "'solution' is a bool"),
    "nan answer": (b'{"prompt": "q", "answer": NaN}', "'answer' is nan"),
    "bad ground truth": (
        {"prompt": "q", "reward_model": "rule"},
        "'reward_model' is a str",
    ),
    "int data_source": ({"prompt": "q", "data_source": 3}, "'data_source' is an int"),
    "float id": ({"prompt_id": 1.5, "prompt": "q"}, "'prompt_id' is a float"),
    "empty id": ({"id": "", "prompt": "q"}, "'id' is an empty string"),
    "not an object": ([1, 2], "record is a list"),
    "broken json": (b'{"prompt": "q"', "not valid JSON"),
    "invalid utf-8": (b'{"prompt": "caf\xe9"}', "not valid UTF-8 (byte 0xe9 at byte 16)"),
    "lone surrogate": (b'{"prompt": "a\\ud800"}', "'prompt' holds an unpaired surrogate"),
}
GOOD = [{"prompt_id": "g1", "prompt": "what is 1?"}, {"prompt_id": "g2", "prompt": "what is 2?"}]


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_line_error_names_file_and_line(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast, case: str
) -> None:
    line, why = BAD_LINES[case]
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD[0], line, GOOD[1]])
    with pytest.raises(ValueError) as info:
        read_prompts(path, tokenizer)
    message = str(info.value)
    assert message.startswith(f"{path}:line 2: ")
    assert why in message
    assert "expected" in message and "on_bad_row='skip'" in message


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_line_skipped_and_counted(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast, case: str
) -> None:
    line, why = BAD_LINES[case]
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD[0], line, GOOD[1]])
    result = read_prompts(path, tokenizer, on_bad_row="skip")
    assert (result.n_rows_read, result.n_skipped_bad) == (3, 1)
    assert column(result, "prompt_id") == ["g1", "g2"]
    assert column(result, "prompt_ids") == [encoded(tokenizer, g["prompt"]) for g in GOOD]
    assert len(result.skipped) == 1
    assert result.skipped[0].startswith(f"{path}:line 2: ") and why in result.skipped[0]


def test_bad_parquet_row_names_row(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"prompt": ["a", None, "c"], "answer": ["1", "2", "3"]}), path)
    with pytest.raises(ValueError, match=f"{path}:row 2: 'prompt' is null; expected"):
        read_prompts(path, tokenizer)
    result = read_prompts(path, tokenizer, on_bad_row="skip")
    assert column(result, "prompt_id") == ["rows:0", "rows:2"]
    assert column(result, "answer") == ["1", "3"]


def test_invalid_utf8_line_keeps_neighbours(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(
        b'\xef\xbb\xbf{"prompt": "caf\xc3\xa9"}\n\n{"prompt": "\xff\xfe"}\r\n{"prompt": "ok"}\n'
    )
    result = read_prompts(path, tokenizer, on_bad_row="skip")
    assert result.n_rows_read == 3 and result.n_skipped_bad == 1
    assert result.skipped == [
        f"{path}:line 3: not valid UTF-8 (byte 0xff at byte 13); expected UTF-8 encoded text"
    ]
    assert column(result, "prompt_id") == ["mixed:0", "mixed:2"]
    assert column(result, "prompt_ids")[0] == encoded(tokenizer, "café")


def test_template_rejection_is_a_bad_row(bpe: Tokenizer) -> None:
    strict = wrap(bpe, USER_ONLY_TEMPLATE)
    chats = pa.table(
        {
            "prompt": [
                [{"role": "user", "content": "a"}],
                [{"role": "system", "content": "s"}, {"role": "user", "content": "b"}],
            ]
        }
    )
    with pytest.raises(ValueError, match="row 2: the chat template rejects.*only user"):
        read_prompts(chats, strict)
    assert read_prompts(chats, strict, on_bad_row="skip").n_skipped_bad == 1


def test_skip_reasons_are_capped(tmp_path: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    path = write_jsonl(tmp_path / "many.jsonl", [{"prompt": 1}] * 150 + [{"prompt": "ok"}])
    result = read_prompts(path, tokenizer, on_bad_row="skip")
    assert result.n_skipped_bad == 150 and len(result.skipped) == MAX_SKIP_REASONS
    assert result.table.num_rows == 1


# -- long prompts -----------------------------------------------------------------------

LONG = "what is " + " plus ".join(str(i) for i in range(40)) + "?"


@pytest.fixture
def long_file(tmp_path: Path) -> Path:
    return write_jsonl(
        tmp_path / "long.jsonl",
        [{"prompt": "what is 1?"}, {"prompt": LONG}, {"prompt": "what is 2?"}],
    )


def test_long_prompt_error(long_file: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    n = len(encoded(tokenizer, LONG))
    with pytest.raises(
        ValueError, match=f"line 2: prompt is {n} tokens, over max_prompt_tokens=16"
    ):
        read_prompts(long_file, tokenizer, max_prompt_tokens=16, on_long_prompt="error")


def test_long_prompt_truncate_keeps_the_end(
    long_file: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    result = read_prompts(long_file, tokenizer, max_prompt_tokens=16, on_long_prompt="truncate")
    assert (result.n_truncated, result.n_skipped_long, result.table.num_rows) == (1, 0, 3)
    assert column(result, "prompt_ids")[1] == encoded(tokenizer, LONG)[-16:]
    assert column(result, "prompt_ids")[0] == encoded(tokenizer, "what is 1?")


def test_long_prompt_skip(long_file: Path, tokenizer: PreTrainedTokenizerFast) -> None:
    result = read_prompts(long_file, tokenizer, max_prompt_tokens=16)
    assert (result.n_truncated, result.n_skipped_long, result.n_rows_read) == (0, 1, 3)
    assert column(result, "prompt_id") == ["long:0", "long:2"]
    assert result.skipped[0].startswith(f"{long_file}:line 2: prompt is ")


# -- accounting -------------------------------------------------------------------------

KINDS = ("plain", "chat", "default_id", "long", *sorted(BAD_LINES))


@settings(max_examples=60, deadline=None)
@given(kinds=st.lists(st.sampled_from(KINDS), max_size=12))
def test_every_record_is_kept_or_counted(
    tokenizer: PreTrainedTokenizerFast, kinds: list[str]
) -> None:
    rows: list[dict | bytes] = []
    expected: list[str] = []
    for i, kind in enumerate(kinds):
        if kind == "plain":
            rows.append({"prompt_id": f"p{i}", "prompt": f"what is {i}?", "answer": i})
        elif kind == "chat":
            rows.append({"id": i, "prompt": [{"role": "user", "content": f"{i}?"}]})
        elif kind == "default_id":
            rows.append({"prompt": f"say {i}"})
        elif kind == "long":
            rows.append({"prompt_id": f"p{i}", "prompt": LONG})
        else:
            rows.append(BAD_LINES[kind][0])
        if kind in ("plain", "chat", "default_id"):
            expected.append({"plain": f"p{i}", "chat": str(i)}.get(kind, f"rows:{i}"))
    with tempfile.TemporaryDirectory() as folder:
        path = write_jsonl(Path(folder) / "rows.jsonl", rows)
        result = read_prompts(path, tokenizer, max_prompt_tokens=24, on_bad_row="skip")
    assert result.n_rows_read == len(kinds)
    assert result.table.num_rows + result.n_skipped_bad + result.n_skipped_long == len(kinds)
    assert column(result, "prompt_id") == expected
    assert result.n_skipped_long == kinds.count("long")
    assert len(result.skipped) == len(kinds) - len(expected)


def test_missing_answers_are_bad_rows_when_required(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    rows = [{"prompt": "a?", "answer": "1"}, {"prompt": "b?"}, {"prompt": "c?", "answer": ""},
            {"prompt": "d?", "solution": "4"}]
    path = write_jsonl(tmp_path / "answers.jsonl", rows)
    with pytest.raises(BadRow, match=r"answers\.jsonl:line 2: no ground truth"):
        read_prompts(path, tokenizer, require_answers=True)
    result = read_prompts(path, tokenizer, require_answers=True, on_bad_row="skip")
    assert column(result, "answer") == ["1", "4"]
    assert result.n_skipped_bad == 2 and result.n_rows_read == 4
    assert len(read_prompts(path, tokenizer).table) == 4  # not required: null stays null
