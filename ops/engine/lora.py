"""LoRA adapters through ``peft``: only the adapters train, are checkpointed and published.

``add_adapters(model, spec)`` injects LoRA layers into the model in place
(``peft.inject_adapter_in_model``: the model keeps its class and its ``forward``, so our
forward passes, the KV cache and FSDP2 see the same module tree) and freezes every other
parameter. ``lora_B`` starts at zero, so a fresh adapter leaves the policy as it was, and a
generation worker with the same spec starts at version 0 without fetching anything.

What moves is the trainable part, ``trainable_state``: the published versions carry the
adapter tensors only (``adapter_bytes`` against the full weights'), as a PEFT adapter
directory (``peft_state`` names them as ``PeftModel.save_pretrained`` does, which is what
vLLM's ``LoRARequest`` reads); the checkpoint stores them and the optimizer state of them;
the frozen base comes from the model directory.
``merge_adapters`` folds an adapter into plain base weights (``W + alpha/r · B A``) for an
exported model that loads without peft.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

ADAPTER_MARK = ".lora_"  # in the name of every adapter tensor
PEFT_PREFIX = "base_model.model."  # the prefix of a PEFT adapter file's tensor names


@dataclass(frozen=True)
class LoraSpec:
    rank: int  # r: the adapters' inner dimension
    alpha: float  # scale alpha / r
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def add_adapters(model: torch.nn.Module, spec: LoraSpec) -> torch.nn.Module:
    """Inject adapters named ``default`` into ``model`` (in place) and freeze the rest."""
    from peft import LoraConfig, inject_adapter_in_model  # the lora extra

    config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha,
                        target_modules=list(spec.target_modules), lora_dropout=0.0,
                        bias="none")
    try:
        inject_adapter_in_model(config, model)
    except ValueError as err:
        raise ValueError(f"lora_target_modules = {list(spec.target_modules)}: {err}") from None
    for name, param in model.named_parameters():
        param.requires_grad_(ADAPTER_MARK in name)
    return model


def is_adapter(name: str) -> bool:
    return ADAPTER_MARK in name


def trainable_state(model: torch.nn.Module,
                    state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a state_dict of ``model``) cut to what trains: the adapters when the model
    has frozen parameters, else all of it."""
    keep = trainable_names(model)
    return state if keep is None else {n: t for n, t in state.items() if n in keep}


def trainable_names(model: torch.nn.Module) -> set[str] | None:
    """Names of the parameters that train; None when all of them do."""
    if all(p.requires_grad for p in model.parameters()):
        return None
    return {n for n, p in model.named_parameters() if p.requires_grad}


def adapter_scale(model: torch.nn.Module) -> float | None:
    """alpha / r of the model's adapters; None without adapters."""
    return next((float(m.scaling["default"]) for m in model.modules()
                 if isinstance(getattr(m, "scaling", None), dict) and "default" in m.scaling),
                None)


def frozen_names(model: torch.nn.Module) -> set[str]:
    """Names of the parameters that do not train (they come from the model directory)."""
    return {n for n, p in model.named_parameters() if not p.requires_grad}


def merge_adapters(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor],
                   scale: float) -> dict[str, torch.Tensor]:
    """Plain weights: each ``<m>.weight`` of ``base`` plus ``scale · B @ A`` of the adapter
    ``<m>.lora_A.default.weight`` / ``<m>.lora_B.default.weight``."""
    out = dict(base)
    for name, a in adapters.items():
        if ".lora_A." not in name:
            continue
        module = name.split(".lora_A.")[0]
        b = adapters[name.replace(".lora_A.", ".lora_B.")]
        weight = out[f"{module}.weight"]
        out[f"{module}.weight"] = (weight.float() + scale * (b.float() @ a.float())
                                   ).to(weight.dtype)
    return out


def lora_config(model: torch.nn.Module):
    """The peft ``LoraConfig`` of the model's adapters (``add_adapters``); None without."""
    return getattr(model, "peft_config", {}).get("default")


def peft_state(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors named as a PEFT adapter file names them: ``<m>.lora_A.default.weight``
    becomes ``base_model.model.<m>.lora_A.weight``."""
    return {PEFT_PREFIX + n.replace(".default.", "."): t for n, t in adapters.items()}


def from_peft_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of ``peft_state``: the names of the model's ``default`` adapters."""
    return {re.sub(r"\.(lora_[AB])\.", r".\1.default.", n.removeprefix(PEFT_PREFIX)): t
            for n, t in state.items()}


def adapter_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for n, t in state.items() if is_adapter(n))
