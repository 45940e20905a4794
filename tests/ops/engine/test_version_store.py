"""A version in memory (``version_files``: pieces of a copy of the tensors) is byte for
byte what ``publish_state`` writes and ``safetensors.torch.save`` makes, full weights and
LoRA adapters alike, and ``install_files`` puts it into another store where the policy loads
from it exactly; that store keeps its ``keep`` newest versions."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from rlhfless.ops.engine import publish
from rlhfless.ops.engine.lora import LoraSpec, add_adapters, lora_config, trainable_state
from rlhfless.ops.engine.publish import load_weights, publish_state, version_files
from rlhfless.ops.engine.version_store import install_files


def _files(path: Path) -> dict[str, bytes]:
    """A published version's files by their path under it ("": the version is the file)."""
    if path.is_file():
        return {"": path.read_bytes()}
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


def _adapted(model: torch.nn.Module) -> torch.nn.Module:
    adapted = add_adapters(copy.deepcopy(model), LoraSpec(rank=4, alpha=8.0))
    with torch.no_grad():  # B starts at zero: give the adapters an effect to carry
        for name, p in adapted.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.linspace(-0.1, 0.1, p.numel()).reshape(p.shape))
    return adapted


def test_a_version_in_memory_is_the_published_files(model, tmp_path, monkeypatch):
    """Its pieces joined are the files, byte for byte; cut at 1 KiB, no piece is larger and
    the joined bytes are the same; the model trained on after leaves them as they were."""
    adapted = _adapted(model)
    for source in (copy.deepcopy(model), adapted):  # trained on below: not the fixture
        state = trainable_state(source, source.state_dict())
        written = publish_state(state, tmp_path / "run", 4, lora=lora_config(source))
        name, files = version_files(state, 4, lora_config(source))
        with monkeypatch.context() as small:
            small.setattr(publish, "PIECE_BYTES", 1024)
            _, cut = version_files(state, 4, lora_config(source))
        with torch.no_grad():
            for tensor in state.values():
                tensor.add_(1.0)
        assert name == Path(written.path).name
        assert _joined(files) == _joined(cut) == _files(Path(written.path))
        tensors = Path(written.path)
        tensors = tensors / publish.ADAPTER_FILE if tensors.is_dir() else tensors
        # the library's own writer, on what the file holds, makes the same bytes
        assert save(load_file(tensors), metadata={"version": "4"}) == tensors.read_bytes()
        pieces = [len(memoryview(p).cast("B")) for rel in cut for p in cut[rel][1:]]
        assert max(pieces) == 1024 and len(pieces) > len(state)


def _joined(files: dict[str, list]) -> dict[str, bytes]:
    return {rel: b"".join(bytes(memoryview(p).cast("B")) for p in pieces)
            for rel, pieces in files.items()}


def test_installed_files_load_the_policy_and_keep_the_newest(model, tmp_path):
    adapted = _adapted(model)
    state = trainable_state(adapted, adapted.state_dict())
    store = tmp_path / "worker"
    for version in (1, 2, 3):
        ref = install_files(*version_files(state, version, lora_config(adapted)), store,
                            version, keep=2)
    assert sorted(p.name for p in store.iterdir()) == ["v2", "v3"]  # no temporary left
    fresh = add_adapters(copy.deepcopy(model), LoraSpec(rank=4, alpha=8.0))
    load_weights(fresh, ref)
    ids = torch.tensor([[5, 9, 17, 3]])
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, adapted(input_ids=ids).logits)
    install_files(*version_files(state, 2, lora_config(adapted)), store, 2, keep=2)
    assert sorted(p.name for p in store.iterdir()) == ["v2"]  # a resumed run's v3 is gone
