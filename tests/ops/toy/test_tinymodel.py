"""The embedded default model: built locally, cached, deterministic, loadable as HF."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhfless.ops.toy.tinymodel import ensure_tiny_model


def test_build_is_cached_and_hf_loadable(tiny_model_dir, quick_recipe):
    again = ensure_tiny_model(tiny_model_dir.parent, quick_recipe, log=print)
    assert again == tiny_model_dir  # no rebuild: same directory, marker present
    assert (tiny_model_dir / "COMPLETE").exists()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.model_type == "llama"
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    text = json.loads((tiny_model_dir / "heldout.jsonl").read_text().splitlines()[0])["prompt"]
    assert tok(text, add_special_tokens=False)["input_ids"] == raw.encode(text).ids
    losses = json.loads((tiny_model_dir / "warm_start.json").read_text())["losses"]
    assert len(losses) == quick_recipe.sft_steps and losses[-1] < losses[0]


def test_same_seed_same_weights(tiny_model_dir, quick_recipe, tmp_path):
    other = ensure_tiny_model(tmp_path, quick_recipe, log=lambda *_: None)
    a = load_file(tiny_model_dir / "model.safetensors")
    b = load_file(other / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not list(tmp_path.glob(".tiny-*"))  # no temporary build left behind
