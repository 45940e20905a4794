"""Shared fixtures: a small tiny-model build (few warm-start steps) cached per session."""

from __future__ import annotations

import pytest

from rlhfless.ops.tinymodel import TinyRecipe, ensure_tiny_model
from rlhfless.ops.tinytask import TallyTask

# Small enough to build in seconds; the full recipe is exercised by the slow tests.
QUICK_RECIPE = TinyRecipe(
    task=TallyTask(max_items=8, n_train=64, n_heldout=16, n_sft=256),
    sft_steps=10,
    sft_batch=16,
    max_positions=128,
)


@pytest.fixture(scope="session")
def quick_recipe():
    return QUICK_RECIPE


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return ensure_tiny_model(tmp_path_factory.mktemp("cache"), QUICK_RECIPE, log=lambda *_: None)
