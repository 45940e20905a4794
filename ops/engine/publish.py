"""Publish and fetch policy weights by integer version.

The trainer publishes each new version as one safetensors file in the run's weight store
(``<store>/v<version>.safetensors``), written to a temporary name and renamed, so a reader
never sees half a file. A generation worker compares its engine's version with the version
its task needs and fetches the newer weights before generating; in synchronous mode that
makes generating from stale weights impossible, and in async mode it bounds how stale they
may be (``require_version``). Async mode keeps at least ``max_staleness + 2`` versions.

Files rather than scatter: they work unchanged on a laptop and on an HPC shared file system,
and a worker that joins late (elastic scale-up) finds every version where it expects it.
Only the ``keep`` newest versions stay on disk.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .engine_types import WeightsRef
from .lora import is_adapter, trainable_state


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
    return publish_state(trainable_state(model, model.state_dict()), store, version, keep)


def publish_state(state: dict[str, torch.Tensor], store: str | Path, version: int,
                  keep: int = 2) -> WeightsRef:
    """``publish_weights`` of a ``state_dict`` (e.g. gathered from sharded ranks)."""
    if keep < 1:
        raise ValueError(f"publish_weights: keep must be >= 1, got {keep}")
    store = Path(store)
    store.mkdir(parents=True, exist_ok=True)
    final = store / f"v{version}.safetensors"
    tmp = store / f".v{version}.{os.getpid()}.tmp"
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    # tied embeddings share storage; safetensors stores one of them
    seen: dict[int, str] = {}
    for name in list(state):
        ptr = state[name].data_ptr()
        if ptr in seen:
            del state[name]
        else:
            seen[ptr] = name
    adapter = bool(state) and all(is_adapter(n) for n in state)
    save_file(state, str(tmp), metadata={"version": str(version), "adapter": str(int(adapter))})
    tmp.chmod(0o666 & ~process_umask())  # safetensors makes it 0600 whatever the umask
    os.replace(tmp, final)
    for old in sorted(store.glob("v*.safetensors"), key=_version_of)[:-keep]:
        old.unlink(missing_ok=True)
    return WeightsRef(version, str(final))


def _version_of(path: Path) -> int:
    return int(path.stem[1:])


def load_weights(model: torch.nn.Module, ref: WeightsRef) -> None:
    """Copy the weights of ``ref`` into ``model`` in place (a directory ref is version 0,
    already loaded with the model)."""
    if Path(ref.path).is_dir():
        return
    state = load_file(ref.path, device=str(next(model.parameters()).device))
    with safe_open(ref.path, "pt") as f:
        adapter = (f.metadata() or {}).get("adapter") == "1"
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if "lm_head" in k or "embed_tokens" in k or adapter}
    if unexpected or set(missing) - tied:
        raise ValueError(
            f"weights {ref.path}: missing {sorted(set(missing) - tied)}, unexpected {unexpected}"
        )
