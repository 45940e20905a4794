"""Shared fixtures of the op tests: the embedded tiny Llama and its tokenizer, built fresh
(no warm start, well under a second) with weights redrawn so that generation paths can be
told apart (``tests/model_support.py``), and a PROMPTS table from texts.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pyarrow as pa
import pytest
import torch
from model_support import eos_prone, redraw

from rlhfless.ops.data.schema import PROMPTS
from rlhfless.ops.toy.tinymodel import TinyRecipe, build_model, build_tokenizer
from rlhfless.ops.toy.tinytask import DATA_SOURCE

torch.set_num_threads(1)  # tiny tensors: threads cost more than they save

@pytest.fixture(scope="session")
def recipe() -> TinyRecipe:
    return TinyRecipe()


@pytest.fixture(scope="session")
def tokenizer(recipe):
    return build_tokenizer(recipe)


@pytest.fixture(scope="session")
def model(recipe, tokenizer):
    """The float32 tiny Llama, in eval mode. Shared by the session: tests that change
    weights work on a ``copy.deepcopy`` of it."""
    return redraw(build_model(recipe, tokenizer), recipe.seed).eval()


@pytest.fixture(scope="session")
def model64(model):
    """The same weights in float64, for comparisons that a near-tie must not flip."""
    return copy.deepcopy(model).double().eval()


@pytest.fixture(scope="session")
def eos_model(model, tokenizer):
    return eos_prone(model, tokenizer)


@pytest.fixture(scope="session")
def eos64(model64, tokenizer):
    """Float64 and EOS-prone."""
    return eos_prone(model64, tokenizer)


def prompts_from_ids(ids: list[list[int]], answers: list[str] | None = None) -> pa.Table:
    """A PROMPTS table of already tokenised prompts, ids ``p0``, ``p1``, ..."""
    return pa.Table.from_pydict(
        {
            "prompt_id": [f"p{i}" for i in range(len(ids))],
            "prompt_ids": ids,
            "answer": answers if answers is not None else [None] * len(ids),
            "data_source": [DATA_SOURCE] * len(ids),
        },
        schema=PROMPTS,
    )


@pytest.fixture(scope="session")
def make_prompts(tokenizer) -> Callable[..., pa.Table]:
    """``make_prompts(texts, answers=None)``: a PROMPTS table of the tokenised texts."""

    def make(texts: list[str], answers: list[str] | None = None) -> pa.Table:
        ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        return prompts_from_ids(ids, answers)

    return make


@pytest.fixture(scope="session")
def ids_prompts() -> Callable[..., pa.Table]:
    """``ids_prompts(ids, answers=None)``: a PROMPTS table of token id lists."""
    return prompts_from_ids
