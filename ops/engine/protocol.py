"""The generation backend protocol: what a generation worker calls, in which order.

A generation worker holds one backend in worker-local state and drives it as the module
docstring of ``backend.py`` shows (``load`` once, then per task ``wake``, ``set_weights``
when the version differs, ``generate``, ``sleep``; ``close`` at the end). Every backend
implements this ABC: ``HFBackend`` (``backend.py``) and ``VLLMBackend`` (``vllm_backend.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import pyarrow as pa

from .gen_stats import GenerationStats
from .generate import SamplingParams
from .publish import WeightsRef


class GenerationBackend(ABC):
    """A generation engine on one worker; see the module docstring for the call order."""

    #: policy version of the weights the engine holds (0: as loaded from ``model_path``)
    version: int = 0
    #: seconds ``load`` took (the cold start), 0 before it ran
    load_seconds: float = 0.0

    @abstractmethod
    def load(self) -> None:
        """Load model and tokenizer. Called once per worker process, before anything else;
        may take long (weights, device memory, compilation): the caller measures it."""

    @abstractmethod
    def close(self) -> None:
        """Release the engine (its memory, threads, any process of its own); nothing when
        closed already. Called at the end of a run, or when the worker holding it leaves."""

    @abstractmethod
    def set_weights(self, ref: WeightsRef) -> None:
        """Replace the weights in place with version ``ref.version`` (a published file, or
        the model directory for version 0) and reset the prefix cache. Called before a
        ``generate`` whose task needs another version than ``version``."""

    @abstractmethod
    def generate(self, prompts: pa.Table, n_samples: int, params: SamplingParams, *,
                 worker: str = "local",
                 share_prefixes: bool = True) -> tuple[pa.Table, GenerationStats]:
        """``n_samples`` responses to every prompt (``prompt_ids``; ``prefix_len`` when
        ``share_prefixes``), with behaviour logprobs; rows prompt-major. ``params.seed``
        (with each prompt's id, ``seeds.py``) makes the draw reproducible on one backend and
        device, whichever shard the prompt is in."""

    @abstractmethod
    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix KV. Called by ``set_weights``; may be called any time
        no request is running."""

    @abstractmethod
    def sleep(self) -> None:
        """Release device memory (weights offloaded, KV dropped) if the engine shares its
        device with the trainer; otherwise nothing. Called after every ``generate``."""

    @abstractmethod
    def wake(self) -> None:
        """Undo ``sleep``; nothing when awake. Called before ``set_weights``/``generate``."""

    @property
    @abstractmethod
    def tokenizer(self):
        """The tokenizer (``pad_token_id``, ``eos_token_id``, ``batch_decode``)."""
