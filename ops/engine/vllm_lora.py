"""What of a LoRA run vLLM can serve, free of torch and vLLM: the config checks it at load
time (``pipeline/config.py``) and the vLLM engine again when it starts (``vllm_backend.py``).

vLLM packs q/k/v into one ``qkv_proj`` and gate/up into ``gate_up_proj`` and serves adapters
on those and on ``o_proj``/``down_proj`` (a Llama-style decoder's projections); the adapter
rank it serves is bounded by ``max_lora_rank``, one of ``LORA_RANKS``.
"""

from __future__ import annotations

VLLM_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM takes


def max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM takes that holds adapters of rank ``rank``."""
    fits = [r for r in LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"lora_rank = {rank}: vLLM serves adapters of rank <= {LORA_RANKS[-1]}")
    return fits[0]


def check_vllm_lora(rank: int, targets: tuple[str, ...] | list[str]) -> None:
    """A one-line ``ValueError`` for adapters vLLM cannot serve (their rank or modules)."""
    max_lora_rank(rank)
    unserved = sorted(set(targets) - set(VLLM_TARGETS))
    if unserved:
        raise ValueError(f"lora_target_modules {unserved}: vLLM serves adapters on "
                         f"{list(VLLM_TARGETS)} only")
