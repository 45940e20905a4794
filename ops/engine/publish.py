"""Publish and fetch policy weights by integer version.

The trainer publishes each new version in the run's weight store: the full weights as one
safetensors file (``<store>/v<version>.safetensors``); a LoRA run's adapters alone as a PEFT
adapter directory (``<store>/v<version>/``: ``adapter_config.json`` and
``adapter_model.safetensors``, as ``PeftModel.save_pretrained`` writes them), which our
engine loads into its adapters and vLLM takes as a ``LoRARequest``. Either is written under a
temporary name and renamed, so a reader never sees half a file or a directory without its
tensors. A generation worker compares its engine's version with the version its task needs
and fetches the newer weights before generating; in synchronous mode that makes generating
from stale weights impossible, and in async mode it bounds how stale they may be
(``require_version``). Async mode keeps at least ``max_staleness + 2`` versions.

Files in the run directory (``weight_store = "run"``) work unchanged on a laptop and on an
HPC shared file system, and a worker that joins late (elastic scale-up) finds every version
where it expects it. Where workers share no disk (``weight_store = "cluster"``), the trainer
holds ``version_files``' bytes instead and each generation worker writes what it fetched
into its own directory with ``install_files`` (``pipeline/tasks/weight_store.py``). Only the
``keep`` newest versions stay, and publishing version N removes any newer one (left by a run
that resumed from an earlier checkpoint).
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file

from .engine_types import WeightsRef
from .lora import from_peft_state, is_adapter, lora_config, peft_state, trainable_state
from .version_store import check_keep, install, process_umask, scratch_path, write_pieces

if TYPE_CHECKING:
    from peft import LoraConfig

    from .version_store import Buffer

ADAPTER_CONFIG = "adapter_config.json"  # a PEFT adapter directory's files
ADAPTER_FILE = "adapter_model.safetensors"
DTYPE_NAMES = {  # safetensors' names of the dtypes weights come in
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2"}
# a held version's pieces are at most Dask's shard size (distributed.comm.shard, 64 MiB):
# each goes as a frame of its own, so the receiver never joins the parts of a split one
PIECE_BYTES = 64 << 20


def publish_weights(model: torch.nn.Module, store: str | Path, version: int,
                    keep: int = 2) -> WeightsRef:
    """Publish what of ``model`` trains: all weights, or its LoRA adapters only."""
    return publish_state(trainable_state(model, model.state_dict()), store, version, keep,
                         lora_config(model))


def publish_state(state: dict[str, torch.Tensor], store: str | Path, version: int,
                  keep: int = 2, lora: LoraConfig | None = None) -> WeightsRef:
    """``publish_weights`` of a ``state_dict`` (e.g. gathered from sharded ranks); adapters
    alone need their ``lora`` config (``lora.lora_config`` of the model)."""
    check_keep(keep)
    state = _stored_state(state)
    tmp = scratch_path(store, version)
    adapters = _adapters_only(state, lora, version)
    if adapters:
        _write_adapter(state, lora, tmp, version)
    else:
        _write_tensors(state, tmp, version)
    return install(tmp, Path(store) / _name(adapters, version), version, keep)


def version_files(state: dict[str, torch.Tensor], version: int,
                  lora: LoraConfig | None = None) -> tuple[str, dict[str, list[Buffer]]]:
    """Version ``version`` in memory, as ``publish_state`` would write it: its name in a
    store (``v<version>.safetensors`` or ``v<version>``) and each file by its path under
    that name (``""``: the name is the file), as the pieces whose bytes in order are the
    file's. The tensors are copied once, where ``state`` holds them, and their pieces are
    views of the copy (a safetensors file is a header, then each tensor's bytes)."""
    stored = _stored_state(state)  # on the CPU: copies of a GPU trainer's tensors already
    state = {k: t.clone() if t.data_ptr() == state[k].data_ptr() else t
             for k, t in stored.items()}  # its own memory: the trainer's changes on
    metadata = {"version": str(version)}
    if not _adapters_only(state, lora, version):
        return _name(False, version), {"": safetensors_pieces(state, metadata)}
    with tempfile.TemporaryDirectory() as scratch:
        lora.save_pretrained(scratch)
        config = (Path(scratch) / ADAPTER_CONFIG).read_bytes()
    return _name(True, version), {ADAPTER_CONFIG: [config],
                                  ADAPTER_FILE: safetensors_pieces(peft_state(state), metadata)}


def safetensors_pieces(state: dict[str, torch.Tensor], metadata: dict[str, str]) -> list[Buffer]:
    """A safetensors file of ``state`` (contiguous CPU tensors) as pieces, no byte copied:
    its header (8-byte little-endian length, then the JSON of each tensor's dtype, shape and
    byte range, space-padded to 8 bytes), then views of the tensors' bytes, each cut in
    pieces of at most ``PIECE_BYTES``: the bytes of ``safetensors.torch.save``, in its
    order (wider elements first, then by name)."""
    order = sorted(state, key=lambda n: (-state[n].element_size(), n))  # as safetensors'
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name in order:
        tensor = state[name]
        end = offset + tensor.numel() * tensor.element_size()
        header[name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    pieces: list[Buffer] = [struct.pack("<Q", len(text)) + text]
    for name in order:
        raw = state[name].reshape(-1).view(torch.uint8).numpy()
        pieces += [raw[i:i + PIECE_BYTES] for i in range(0, raw.size, PIECE_BYTES)]
    return pieces


def _stored_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` contiguous on the CPU, tied tensors once (safetensors stores one of them)."""
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    seen: dict[int, str] = {}
    for name in list(state):
        ptr = state[name].data_ptr()
        if ptr in seen:
            del state[name]
        else:
            seen[ptr] = name
    return state


def _adapters_only(state: dict[str, torch.Tensor], lora: LoraConfig | None,
                   version: int) -> bool:
    """Whether ``state`` is LoRA adapters alone (published as a PEFT directory)."""
    if not (state and all(is_adapter(n) for n in state)):
        return False
    if lora is None:
        raise ValueError(f"publish_weights v{version}: adapters without their LoraConfig")
    return True


def _name(adapters: bool, version: int) -> str:
    """A version's name in a store: an adapter directory, or a weights file."""
    return f"v{version}" if adapters else f"v{version}.safetensors"


def _write_tensors(state: dict[str, torch.Tensor], path: Path, version: int) -> None:
    """A safetensors file of ``state`` written from the tensors' own memory (per tensor,
    ``save_file``'s Python costs more than an adapter's bytes take to write)."""
    write_pieces(path, safetensors_pieces(state, {"version": str(version)}))


def _write_adapter(state: dict[str, torch.Tensor], lora: LoraConfig, tmp: Path,
                   version: int) -> None:
    """A PEFT adapter directory at ``tmp``: its config and its tensors under PEFT's names."""
    tmp.mkdir(mode=0o777 & ~process_umask())
    lora.save_pretrained(str(tmp))
    _write_tensors(peft_state(state), tmp / ADAPTER_FILE, version)


def is_adapter_dir(path: str | Path) -> bool:
    """Whether ``path`` is a published adapter directory (else a file, or a model dir)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def load_weights(model: torch.nn.Module, ref: WeightsRef) -> None:
    """Copy the weights of ``ref`` into ``model`` in place: a weights file, or an adapter
    directory into the model's adapters (a model directory is version 0, already loaded with
    the model)."""
    adapter = is_adapter_dir(ref.path)
    if Path(ref.path).is_dir() and not adapter:
        return
    device = str(next(model.parameters()).device)
    state = (from_peft_state(load_file(str(Path(ref.path) / ADAPTER_FILE), device=device))
             if adapter else load_file(ref.path, device=device))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if "lm_head" in k or "embed_tokens" in k or adapter}
    if unexpected or set(missing) - tied:
        raise ValueError(
            f"weights {ref.path}: missing {sorted(set(missing) - tied)}, unexpected {unexpected}"
        )
