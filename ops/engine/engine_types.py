"""The values the engine protocol passes (``protocol.py``), free of torch: a driver, a
scheduler or an engine with no model (the emulated one) uses them without loading a
framework. ``tests/ops/engine/test_protocol_imports.py`` holds that importing the protocol
loads neither torch nor transformers nor vllm."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from .gen_stats import GenerationStats


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False  # argmax decoding (evaluation); temperature then only scales logprobs
    seed: int = 0  # the generation seed (seeds.generation_seed): keys every sequence's draws

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class RemoteStore:
    """A store of versions at an fsspec URL (``weight_store = "s3://bucket/prefix"``):
    ``options`` are the file system's storage options as (key, value) pairs, by key;
    ``keep`` the versions kept there, and in each reader's local copy."""

    url: str
    options: tuple[tuple[str, Any], ...] = ()
    keep: int = 2


@dataclass(frozen=True)
class WeightsRef:
    """Where version ``version`` of the policy lives; small enough to travel in a graph."""

    version: int
    path: str  # a safetensors file, or a Hugging Face model directory for version 0
    # the address of the worker that holds this version in memory (weight_store = "cluster"):
    # ``path`` is then the version's name in a store, fetched from there before loading
    holder: str | None = None
    # the URL store that holds this version (weight_store = an fsspec URL): ``path`` is then
    # the version's path under its URL, copied from there before loading
    remote: RemoteStore | None = None
    nbytes: int = 0  # the version's bytes as published (its files); 0: not published by us


def require_version(have: int, need: int, where: str, max_staleness: int = 0) -> None:
    """A worker may generate from version ``need`` or, in async mode, from one at most
    ``max_staleness`` versions older; never from a newer one. ``need`` is the version of the
    trainer that will consume the samples. Synchronous mode (``max_staleness=0``): exactly
    ``need``."""
    if max_staleness < 0:
        raise ValueError(f"{where}: max_staleness must be >= 0, got {max_staleness}")
    if need - max_staleness <= have <= need:
        return
    if max_staleness == 0:
        raise RuntimeError(f"{where}: engine holds policy v{have} but the task needs v{need}")
    raise RuntimeError(f"{where}: engine holds policy v{have} but the task allows "
                       f"v{max(0, need - max_staleness)}..v{need} (max_staleness={max_staleness})")


def check_limit(longest: int, limit: int | None) -> None:
    """A ``ValueError`` when ``longest`` tokens exceed a context of ``limit`` (None: none)."""
    if limit is not None and longest > limit:
        raise ValueError(
            f"prompt + max_new_tokens = {longest} tokens exceeds the model's context of {limit}"
        )


#: what the elastic policy may do with a paused tail (``GenerationBackend.tail_actions``):
#: resume it in place; move it with its KV cache, or recomputed; split it (the worker
#: predicted last sheds sequences to the one predicted first); reconfigure (every tail
#: consolidated onto one engine made wider: more threads on a CPU, a larger TP on GPUs)
TAIL_ACTIONS = ("stay", "kv", "recompute", "split", "reconfig")


@dataclass(frozen=True)
class StopRule:
    """When ``generate_until`` stops: once ``until_finished`` of the sequences are done, or
    after a step where ``pause()`` says so (the driver wants the tail elsewhere), or at the
    ``deadline`` (a ``time.perf_counter()`` value)."""

    until_finished: float = 1.0
    pause: Callable[[], bool] | None = None
    deadline: float | None = None

    def interrupted(self) -> bool:
        """Whether generation should stop now, whatever is finished."""
        if self.deadline is not None and time.perf_counter() >= self.deadline:
            return True
        return self.pause is not None and self.pause()


@dataclass
class Chunk:
    """What ``generate_until`` hands back: the finished rows (``done``, ROLLOUTS), the cut
    ones with their tokens so far (``cut``: the shard's rows plus ``partial_ids`` and
    ``partial_logprobs``), and the engine's own handle on them (``paused``: for
    ``resume`` and ``export_paused`` on this engine; None when nothing was cut)."""

    done: pa.Table
    cut: pa.Table
    stats: GenerationStats
    paused: Any = None


@dataclass
class Turn:
    """One episode's next turn for ``decode_turns``: the conversation so far as token ids
    (prompt, every turn sampled and every observation appended, in order), the tokens it may
    generate, its sampling key, and the engine's state kept from the episode's previous
    turn or request (``cache``: None at the first; the engine sets it, and runs only the ids
    it has not seen: a context that departs from what it kept, such as an agent's history
    rendered again, runs from where it departs)."""

    context: list[int]
    budget: int
    key: int
    cache: Any = None
    result: tuple[list[int], list[float], str] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class EngineSpec:
    """What a worker needs to build its engine; an engine takes the options it has."""

    model_path: str
    device: str = "auto"
    threads: int = 1
    backend: str = "hf"  # an ENGINES name, or "module:Class"
    colocate: bool = False  # the engine sleeps between rollouts, freeing the trainer's device
    lora: Any = None  # LoRA adapters on the model (``lora.LoraSpec``): only they train and move
    dtype: str = "auto"  # the engine's weights: "auto" or one of its class's ``dtypes``
    gpu_memory_utilization: float = 0.15  # vllm: its share of device memory (CPU: of RAM)
    options: dict = field(default_factory=dict)  # engine-specific, by the engine's parameter names
