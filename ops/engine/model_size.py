"""A model's parameters and a LoRA adapter's, from its ``config.json`` alone.

The model is built on PyTorch's meta device (shapes only: no memory, no weights read), so a
driver prices a 0.5B or 7B model's weights in a second without loading them; the adapter is
injected as the trainer injects it (``lora.add_adapters``), so its count is what each
version of a LoRA run sends. Tied embeddings count once.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from .lora import LoraSpec, add_adapters


def model_params(model_path: str | Path, lora: LoraSpec | None = None) -> tuple[int, int | None]:
    """(the model's parameters, its adapter's; None without ``lora``)."""
    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    if lora is None:
        return params, None
    add_adapters(model, lora)
    return params, sum(p.numel() for p in model.parameters() if p.requires_grad)
