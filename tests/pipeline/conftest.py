"""Fixtures of the pipeline tests: a model whose greedy responses end at different lengths."""

from __future__ import annotations

import pytest
from model_support import eos_prone, redraw

from rlhfless.ops.toy.tinymodel import TinyRecipe, build_model


@pytest.fixture(scope="session")
def eos_model_dir(tiny_model_dir, tmp_path_factory):
    """The embedded architecture, redrawn and EOS-prone (``tests/model_support.py``), saved
    as a model directory, so that greedy decoding ends at different lengths per prompt and a
    pause leaves a tail."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("eos-model")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    recipe = TinyRecipe()
    model = eos_prone(redraw(build_model(recipe, tok), recipe.seed), tok)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "train.jsonl").write_text((tiny_model_dir / "train.jsonl").read_text())
    return out
