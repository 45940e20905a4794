"""Fixtures of the pipeline tests: a model whose greedy responses end at different lengths."""

from __future__ import annotations

import pytest

from rlhfless.ops.tinymodel import TinyRecipe, build_model


@pytest.fixture(scope="session")
def eos_model_dir(tiny_model_dir, tmp_path_factory):
    """The embedded architecture with weights redrawn at a larger spread and the (tied) EOS
    embedding scaled up (as ``tests/ops/conftest.py`` does), so that greedy decoding ends
    at different lengths per prompt and a pause leaves a tail."""
    import torch
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("eos-model")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    recipe = TinyRecipe()
    model = build_model(recipe, tok)
    gen = torch.Generator().manual_seed(recipe.seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.2, generator=gen)
        model.model.embed_tokens.weight[tok.eos_token_id] *= 2.0
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "train.jsonl").write_text((tiny_model_dir / "train.jsonl").read_text())
    return out
