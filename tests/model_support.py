"""Test weights for comparing generation paths (shared by the op and pipeline tests).

At the Hugging Face default scale every logit of the embedded tiny Llama is nearly equal
and every prompt decodes to the same repeated token, so a test comparing two generation
paths would prove little. ``redraw`` gives each prompt its own, context-dependent
continuation (EOS comes up now and then); ``eos_prone`` makes EOS frequent enough that
rows leave the batch mid-decode and pauses leave tails.
"""

from __future__ import annotations

import copy

import torch

WEIGHT_STD = 0.2


def redraw(net: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``net`` with its embeddings and projections redrawn at ``WEIGHT_STD`` (the norms stay
    at 1), in place; returned for chaining."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in net.parameters():
            if param.dim() == 2:
                param.normal_(0.0, WEIGHT_STD, generator=gen)
    return net


def eos_prone(net: torch.nn.Module, tokenizer) -> torch.nn.Module:
    """A copy of ``net`` that often, but not always, emits EOS (its tied EOS embedding scaled
    up)."""
    eager = copy.deepcopy(net)
    with torch.no_grad():
        eager.model.embed_tokens.weight[tokenizer.eos_token_id] *= 2.0
    return eager
