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

Files rather than scatter: they work unchanged on a laptop and on an HPC shared file system,
and a worker that joins late (elastic scale-up) finds every version where it expects it.
Only the ``keep`` newest versions stay on disk, and publishing version N removes any newer
one (left by a run that resumed from an earlier checkpoint).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from .engine_types import WeightsRef
from .lora import from_peft_state, is_adapter, lora_config, peft_state, trainable_state

if TYPE_CHECKING:
    from peft import LoraConfig

ADAPTER_CONFIG = "adapter_config.json"  # a PEFT adapter directory's files
ADAPTER_FILE = "adapter_model.safetensors"
_VERSION = re.compile(r"v(\d+)(?:\.safetensors)?")  # a published version's name


def process_umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets one to read it, and
    a file another thread made meanwhile would get that one)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o077)  # no /proc: the strictest in the meantime
    os.umask(mask)
    return mask


def publish_weights(model: torch.nn.Module, store: str | Path, version: int,
                    keep: int = 2) -> WeightsRef:
    """Publish what of ``model`` trains: all weights, or its LoRA adapters only."""
    return publish_state(trainable_state(model, model.state_dict()), store, version, keep,
                         lora_config(model))


def publish_state(state: dict[str, torch.Tensor], store: str | Path, version: int,
                  keep: int = 2, lora: LoraConfig | None = None) -> WeightsRef:
    """``publish_weights`` of a ``state_dict`` (e.g. gathered from sharded ranks); adapters
    alone need their ``lora`` config (``lora.lora_config`` of the model)."""
    if keep < 1:
        raise ValueError(f"publish_weights: keep must be >= 1, got {keep}")
    store = Path(store)
    store.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    # tied embeddings share storage; safetensors stores one of them
    seen: dict[int, str] = {}
    for name in list(state):
        ptr = state[name].data_ptr()
        if ptr in seen:
            del state[name]
        else:
            seen[ptr] = name
    tmp = store / f".v{version}.{os.getpid()}.tmp"
    if state and all(is_adapter(n) for n in state):
        if lora is None:
            raise ValueError(f"publish_weights v{version}: adapters without their LoraConfig")
        final = store / f"v{version}"
        _write_adapter(state, lora, tmp, version)
    else:
        final = store / f"v{version}.safetensors"
        _write_tensors(state, tmp, version)
    _rename_into(tmp, final)
    published = sorted(_published(store))
    kept = [path for v, path in published if v <= version][-keep:]
    for _, path in published:
        if path not in kept:
            _remove(path)
    return WeightsRef(version, str(final))


def _write_tensors(state: dict[str, torch.Tensor], path: Path, version: int) -> None:
    save_file(state, str(path), metadata={"version": str(version)})
    path.chmod(0o666 & ~process_umask())  # safetensors makes it 0600 whatever the umask


def _write_adapter(state: dict[str, torch.Tensor], lora: LoraConfig, tmp: Path,
                   version: int) -> None:
    """A PEFT adapter directory at ``tmp``: its config and its tensors under PEFT's names."""
    tmp.mkdir(mode=0o777 & ~process_umask())
    lora.save_pretrained(str(tmp))
    _write_tensors(peft_state(state), tmp / ADAPTER_FILE, version)


def _rename_into(tmp: Path, final: Path) -> None:
    """``tmp`` becomes ``final``; a directory there already (a version published again
    after a resume) is moved aside first, since a rename does not replace a full one."""
    if final.is_dir():
        aside = final.with_name(f".{final.name}.{os.getpid()}.old")
        os.replace(final, aside)
        shutil.rmtree(aside)
    os.replace(tmp, final)


def _published(store: Path) -> list[tuple[int, Path]]:
    """(version, path) of every version in ``store``: files and adapter directories."""
    found = []
    for path in store.iterdir():
        m = _VERSION.fullmatch(path.name)
        if m:
            found.append((int(m.group(1)), path))
    return found


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


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
