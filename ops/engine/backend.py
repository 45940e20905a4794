"""The generation backends: the transformers one, and ``make_backend`` to pick one.

A generation worker holds one backend in worker-local state (``pipeline/tasks/rollout.py``) and
drives it in this order:

    backend = make_backend("hf" | "vllm", model_path, ...)
    backend.load()                          once: the worker's cold start, measured
    loop over tasks:
        backend.wake()                      colocated engines only: memory back first
        if backend.version != task version:
            backend.set_weights(ref)        in place; resets the prefix cache
        table, stats = backend.generate(prompts, n_samples, params, worker=...)
        backend.sleep()                     colocated: free the device for the trainer
    backend.close()                         at the end (a worker's exit ends it too)

``generate`` returns one row per (prompt, sample), prompt-major, in ``schema.ROLLOUTS``
(every prompt column kept), with the behaviour policy's log-probability of each sampled
token, and a ``GenerationStats``. A backend never serves KV computed by older weights:
``set_weights`` resets whatever prefix cache it keeps.

The protocol (``GenerationBackend``) is in ``backend_protocol.py``, where every backend
(``vllm_backend.py`` too) takes it from. ``HFBackend`` is our own decode loop
(``generate.py``) over a transformers causal LM: the shared-prefix KV is computed per call
and dropped with it, so it keeps no cache between calls, and sleeping is not needed on CPU.
``VLLMBackend`` (``vllm_backend.py``) is imported only when asked for, so that vLLM stays
an optional dependency.
"""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from .gen_stats import GenerationStats
from .generate import SamplingParams, generate_rollouts
from .lora import LoraSpec, add_adapters
from .protocol import GenerationBackend
from .publish import WeightsRef, load_weights

BACKENDS = ("hf", "vllm")
DTYPES = ("auto", "float32", "float64", "bfloat16", "float16")  # of the hf engine's weights


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The weights' dtype: ``auto`` is bf16 on CUDA, fp32 on CPU; else the one named."""
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: choose one of {', '.join(DTYPES)}")
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class HFBackend(GenerationBackend):
    """transformers model + our decode loop; bf16 on CUDA, fp32 on CPU unless ``dtype``
    names another, torch pinned to ``threads`` (each worker's share of the cores).
    ``model`` is public: the elastic policy's chunked generation (pause at τ, resume or
    migrate) drives the decode loop directly."""

    def __init__(self, model_path: str | Path, device: str = "auto", threads: int = 1,
                 lora: LoraSpec | None = None, dtype: str = "auto") -> None:
        self.model_path, self.device_name, self.threads = str(model_path), device, threads
        self.dtype_name = dtype
        self.lora = lora  # adapters on the model (ops/engine/lora.py); published versions carry
                          # them
        self.model: torch.nn.Module | None = None
        self._tokenizer = None

    def load(self) -> None:
        started = time.perf_counter()
        hf_logging.disable_progress_bar()
        torch.set_num_threads(self.threads)
        device = resolve_device(self.device_name)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=resolve_dtype(self.dtype_name, device)).to(device).eval()
        if self.lora is not None:
            add_adapters(self.model, self.lora)
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.load_seconds = time.perf_counter() - started

    @property
    def tokenizer(self):
        return self._tokenizer

    def set_weights(self, ref: WeightsRef) -> None:
        load_weights(self._loaded(), ref)
        self.version = ref.version
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Nothing to reset: prefix KV lives only inside one ``generate`` call."""

    def sleep(self) -> None:
        """Nothing to release: the hf engine is not colocated with the trainer."""

    def wake(self) -> None:
        """Never asleep."""

    def generate(self, prompts: pa.Table, n_samples: int, params: SamplingParams, *,
                 worker: str = "local",
                 share_prefixes: bool = True) -> tuple[pa.Table, GenerationStats]:
        return generate_rollouts(self._loaded(), self._tokenizer, prompts, n_samples, params,
                                 policy_version=self.version, worker=worker,
                                 share_prefixes=share_prefixes)

    def close(self) -> None:
        self.model = None

    def _loaded(self) -> torch.nn.Module:
        if self.model is None:
            raise RuntimeError(f"HFBackend({self.model_path}): call load() first")
        return self.model


def make_backend(name: str, model_path: str | Path, device: str = "auto", threads: int = 1,
                 colocate: bool = False, lora: LoraSpec | None = None,
                 dtype: str = "auto", gpu_memory_utilization: float = 0.15) -> GenerationBackend:
    """The backend called ``name`` (one of ``BACKENDS``), not loaded yet. ``colocate``: the
    engine shares its device with the trainer and sleeps between rollouts (vllm); ``dtype``:
    the engine's weights (one of ``DTYPES``); ``gpu_memory_utilization``: the share of the
    device's memory a vllm engine takes (on CPU: of the RAM)."""
    if name == "hf":
        return HFBackend(model_path, device, threads, lora, dtype)
    if name == "vllm":
        from .vllm_backend import VLLMBackend  # optional dependency: only when asked for

        return VLLMBackend(model_path, colocate=colocate, dtype=dtype, threads=threads,
                           gpu_memory_utilization=gpu_memory_utilization)
    raise ValueError(f"backend {name!r}: choose one of {BACKENDS}")
