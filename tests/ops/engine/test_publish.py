"""Tests of weight publishing: a round trip through the store reproduces the policy
exactly, tied embeddings included; old versions are pruned; no temporary file is left; a
LoRA version is a PEFT adapter directory that peft itself loads."""

from __future__ import annotations

import copy
import os
import stat
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaForCausalLM

from rlhfless.ops.engine.engine_types import WeightsRef, require_version
from rlhfless.ops.engine.lora import LoraSpec, add_adapters, is_adapter
from rlhfless.ops.engine.publish import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    load_weights,
    process_umask,
    publish_weights,
)
from rlhfless.ops.toy.tinymodel import build_model


@pytest.fixture
def fresh(recipe, tokenizer):
    """A model of the same shape as ``model`` with other weights."""
    return build_model(replace(recipe, seed=recipe.seed + 1), tokenizer)


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_round_trip_with_tied_embeddings(model, fresh, tmp_path):
    assert model.config.tie_word_embeddings
    assert not torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    ref = publish_weights(model, tmp_path, version=3)
    assert ref == WeightsRef(3, str(tmp_path / "v3.safetensors"))
    with safe_open(ref.path, "pt") as f:
        assert f.metadata()["version"] == "3"
        stored = set(f.keys())
    assert len(stored) == len(model.state_dict()) - 1  # one copy of the tied matrix

    load_weights(fresh, ref)
    assert_same_state(fresh, model)
    assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(fresh.eval()(input_ids=ids).logits, model(input_ids=ids).logits)


def test_round_trip_untied(model, tmp_path):
    config = copy.deepcopy(model.config)
    config.tie_word_embeddings = False
    torch.manual_seed(1)
    untied = LlamaForCausalLM(config)
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)
    torch.manual_seed(2)
    target = LlamaForCausalLM(config)
    load_weights(target, publish_weights(untied, tmp_path, version=1))
    assert_same_state(target, untied)


def test_only_the_newest_versions_stay(model, tmp_path):
    for version in range(1, 12):  # past v9, so names would sort wrongly as text
        ref = publish_weights(model, tmp_path, version, keep=2)
    assert ref.version == 11
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v10.safetensors", "v11.safetensors"]
    publish_weights(model, tmp_path, 12, keep=3)
    names = sorted(p.name for p in tmp_path.iterdir())  # nothing else: no temporary files
    assert names == ["v10.safetensors", "v11.safetensors", "v12.safetensors"]
    with pytest.raises(ValueError, match="keep must be >= 1"):
        publish_weights(model, tmp_path, 13, keep=0)


def test_directory_ref_is_a_no_op(fresh, tmp_path):
    before = copy.deepcopy(fresh)
    load_weights(fresh, WeightsRef(0, str(tmp_path)))
    assert_same_state(fresh, before)


def test_weights_of_another_model_are_refused(model, fresh, tmp_path):
    state = {k: v.clone() for k, v in model.state_dict().items() if "layers.3." not in k}
    state.pop("lm_head.weight")
    state["extra.weight"] = torch.zeros(2)
    path = tmp_path / "v5.safetensors"
    save_file(state, str(path))
    with pytest.raises(ValueError, match=r"missing \['model\.layers\.3\..*unexpected \['extra"):
        load_weights(fresh, WeightsRef(5, str(path)))


def test_require_version():
    require_version(4, 4, "worker w-1")
    with pytest.raises(RuntimeError, match="w-1: engine holds policy v3 but the task needs v4"):
        require_version(3, 4, "worker w-1")


@pytest.mark.parametrize(("umask", "mode"), [(0o077, 0o600), (0o022, 0o644)])
def test_published_weights_have_the_mode_the_umask_gives(model, tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        assert process_umask() == umask
        ref = publish_weights(model, tmp_path, version=1)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(ref.path).st_mode) == mode  # safetensors alone: 0600


def adapted(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A copy of ``model`` with LoRA adapters whose weights are drawn under ``seed``."""
    out = add_adapters(copy.deepcopy(model), LoraSpec(rank=4, alpha=8.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in out.named_parameters():
            if is_adapter(name):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return out


def test_adapters_are_a_peft_directory_that_peft_loads(model, tmp_path):
    """A LoRA version is the adapter alone, as ``PeftModel.save_pretrained`` writes it: peft
    itself loads it onto the base and computes what the trainer's model computes."""
    from peft import PeftModel

    trainer = adapted(model, seed=1)
    for version in (1, 2, 3):
        ref = publish_weights(trainer, tmp_path, version, keep=2)
    assert ref == WeightsRef(3, str(tmp_path / "v3"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2", "v3"]  # no temporary left
    assert sorted(p.name for p in (tmp_path / "v3").iterdir()) == [ADAPTER_CONFIG, ADAPTER_FILE]
    with safe_open(str(tmp_path / "v3" / ADAPTER_FILE), "pt") as f:
        assert f.metadata()["version"] == "3" and all(is_adapter(n) for n in f.keys())
    peft_model = PeftModel.from_pretrained(copy.deepcopy(model), ref.path)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(peft_model(input_ids=ids).logits, trainer(input_ids=ids).logits)


def test_a_version_published_again_replaces_it_and_drops_newer_ones(model, tmp_path):
    """A run resumed from v2 publishes v2 again: its directory is replaced whole, and v3, v4
    (abandoned) go; our engine's adapters then load the new v2."""
    for version in (1, 2, 3, 4):
        publish_weights(adapted(model, seed=version), tmp_path, version, keep=3)
    again = adapted(model, seed=20)
    ref = publish_weights(again, tmp_path, 2, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2"]
    generator = adapted(model, seed=0)
    load_weights(generator, ref)
    assert_same_state(generator, again)
