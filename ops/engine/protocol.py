"""The generation engine protocol: everything the pipeline asks of an engine, in which order.

A generation worker holds one engine in worker-local state (``pipeline/tasks/rollout.py``)
and drives it only through this protocol; no task outside ``ops/`` touches an engine's
model. Every engine implements it: ``HFBackend`` (``backend.py``, our decode loop over a
transformers model), ``VLLMBackend`` (``vllm_backend.py``) and ``EmulatedEngine``
(``pipeline/tasks/emulated.py``: a GPU profile's clock, no model). The call order:

    engine = make_engine(spec)              registry.py: the engine the spec names
    engine.load()                             once: the worker's cold start, measured
    per task:
        engine.wake()                         colocated engines only: memory back first
        if engine.version != task version:
            engine.set_weights(ref)           in place, version checked; resets the prefix
                                              cache, so no KV outlives its weights
        one of
          engine.generate(prompts, n, params)              a shard whole
          engine.generate_until(prompts, n, params, stop)  until the stop rule: a Chunk
              then, for its unfinished rows (``chunk.cut``), one of
              engine.resume(chunk.paused, params)    here (KV kept where the engine can)
              engine.continue_rows(cut, params)      anywhere: prompt + tokens so far again
              engine.export_paused / adopt          (``exports_kv`` engines) KV moved
          engine.decode_turns(turns, params, ...)  one turn of each episode (multi-turn)
        engine.sleep()                        colocated: free the device for the trainer
    engine.close()                            at the end; a worker's exit ends it too

Rows are ``schema.ROLLOUTS`` (one per (prompt, sample), prompt-major, every prompt column
kept) with the behaviour policy's log-probability of each sampled token. A cut row carries
``partial_ids`` and ``partial_logprobs``: its tokens so far, which a continuation extends
(they count against ``max_new_tokens``), so the row it lands as holds them all.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import pyarrow as pa

from .engine_types import (
    Chunk,
    EngineSpec,
    SamplingParams,
    StopRule,
    Turn,
    WeightsRef,
    check_limit,
)
from .gen_stats import GenerationStats


class GenerationBackend(ABC):
    """A generation engine on one worker; see the module docstring for the call order."""

    #: policy version of the weights the engine holds (0: as loaded from ``model_path``)
    version: int = 0
    #: seconds ``load`` took (the cold start), 0 before it ran
    load_seconds: float = 0.0
    #: whether a paused decoding can leave with its KV cache (``export_paused``/``adopt``);
    #: otherwise a move recomputes the context on its target (``continue_rows``)
    exports_kv: bool = False
    #: what the elastic policy may do with this engine's paused tails (``TAIL_ACTIONS``):
    #: every engine resumes in place and recomputes a moved tail; "kv", "split" (part of a
    #: paused batch leaves, the rest resumes) and "reconfig" (tails consolidated onto one
    #: engine that decodes with more threads) need ``export_paused``/``adopt``
    tail_actions: frozenset[str] = frozenset({"stay", "recompute"})
    #: whether a reconfiguration's sources leave once their tails landed (threads of one
    #: machine given to its target) or stay held by the target until it ends (a wider TP
    #: over their GPUs)
    reconfig_releases: bool = True
    #: the weight dtypes ``EngineSpec.dtype`` may name for this engine ("auto": its choice)
    dtypes: tuple[str, ...] = ("auto",)
    #: whether generating takes this machine's cores (false for an engine that only sleeps
    #: on a profile's clock: an async run's pools then keep their configured sizes)
    computes: bool = True

    @classmethod
    def from_spec(cls, spec: EngineSpec, ram_bytes: int | None = None) -> GenerationBackend:
        """The engine of ``spec``, not loaded: ``__init__`` gets the spec's fields, its
        ``options`` and ``ram_bytes`` (what a CPU engine may hold) that it names as
        parameters."""
        options = ({f.name: getattr(spec, f.name) for f in fields(spec)} | spec.options
                   | {"ram_bytes": ram_bytes})
        accepted = inspect.signature(cls.__init__).parameters
        return cls(**{k: v for k, v in options.items() if k in accepted and k != "self"})

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
        the model directory for version 0) and reset the prefix cache."""

    @abstractmethod
    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix KV. Called by ``set_weights``; may be called any time
        no request is running."""

    @abstractmethod
    def generate(self, prompts: pa.Table, n_samples: int, params: SamplingParams, *,
                 worker: str = "local",
                 share_prefixes: bool = True) -> tuple[pa.Table, GenerationStats]:
        """``n_samples`` responses to every prompt (``prompt_ids``; ``prefix_len`` when
        ``share_prefixes``), with behaviour logprobs; rows prompt-major. ``params.seed``
        (with each prompt's id, ``seeds.py``) makes the draw reproducible on one engine and
        device, whichever shard the prompt is in."""

    @abstractmethod
    def generate_until(self, prompts: pa.Table, n_samples: int, params: SamplingParams,
                       stop: StopRule, *, worker: str = "local",
                       share_prefixes: bool = True) -> Chunk:
        """As ``generate``, until ``stop``: the finished rows, and the unfinished ones cut
        with their tokens and behaviour logprobs so far (see ``Chunk``)."""

    @abstractmethod
    def resume(self, paused: Any, params: SamplingParams, *,
               worker: str = "local") -> tuple[pa.Table, GenerationStats]:
        """Finish the rows a ``generate_until`` of this engine paused (``Chunk.paused``),
        their draws keyed as the chunk's were; ``params``: the run's sampling otherwise."""

    @abstractmethod
    def continue_rows(self, cut: pa.Table, params: SamplingParams, *,
                      worker: str = "local") -> tuple[pa.Table, GenerationStats]:
        """Finish cut rows (``Chunk.cut``, from any engine of the same weights) from prompt +
        tokens so far, recomputed (cheap where the engine's prefix cache holds them); their
        draws are keyed by ``params.seed`` and each row's prompt and sample."""

    @abstractmethod
    def decode_turns(self, turns: list[Turn], params: SamplingParams,
                     stats: GenerationStats, *, keep_cache: bool = True,
                     on_leave: Callable[[int, list[int]], None] | None = None) -> None:
        """Sample one turn for each of ``turns`` (token-exact: the ids are the model's, never
        re-tokenized), setting each ``turn.result`` to (ids, logprobs, "stop" | "length").
        ``on_leave(i, ids)`` is called as soon as turn ``i`` is over (its ``result`` and
        ``cache`` set), while the others may still decode, so that its environment step can
        start, or its request be answered. ``keep_cache``: keep what the
        engine can of each conversation for its next turn in ``turn.cache``."""

    @abstractmethod
    def step_seconds(self, batch: int, steps: int, prompt_tokens: int) -> float:
        """Seconds per decode step of a batch of ``batch`` sequences (``steps`` tokens each,
        no EOS stop, after ``prompt_tokens``-token prompts), as this engine runs now."""

    @property
    @abstractmethod
    def max_context(self) -> int | None:
        """Tokens the engine's model takes at most (prompt + response), None if unknown."""

    def widen(self, width: int) -> int:
        """Decode on ``width`` times this worker's own share from now on (a reconfigured
        tail's target: torch threads on a CPU, the tensor-parallel degree of a GPU engine;
        1 restores the worker's own); returns the width before. Engines with ``reconfig``
        in ``tail_actions`` only."""
        raise NotImplementedError(f"{type(self).__name__} cannot decode wider")

    @classmethod
    def kv_link_bytes_per_s(cls, spec: EngineSpec) -> float | None:
        """Bytes per second a KV cache crosses between two workers, where the engine knows
        it (the prior of a KV move's cost, before a transfer is measured); None: the
        transfer model's own prior."""
        return None

    @classmethod
    def kv_bytes_per_token(cls, spec: EngineSpec) -> float | None:
        """Bytes of one context token's KV cache on an engine of ``spec`` (at its weights'
        dtype), for ``exports_kv`` engines: the prior of a KV move's cost, before a transfer
        is measured. None for engines that export none."""
        return None

    def check_context(self, longest: int) -> None:
        """A ``ValueError`` when ``longest`` tokens exceed the model's context."""
        check_limit(longest, self.max_context)

    def export_paused(self, paused: Any, positions: list[int] | None = None) -> Any:
        """The paused rows at ``positions`` (all: None) with their KV cache, for ``adopt``
        on another worker; the others stay in ``paused``. ``exports_kv`` engines only."""
        raise NotImplementedError(f"{type(self).__name__} keeps no exportable KV cache")

    def adopt(self, tails: list[Any], recompute: pa.Table | None, params: SamplingParams,
              stats: GenerationStats) -> Any:
        """One paused decoding here from exported ``tails`` and cut rows to ``recompute``;
        ``resume`` finishes it. ``exports_kv`` engines only."""
        raise NotImplementedError(f"{type(self).__name__} keeps no exportable KV cache")

    @abstractmethod
    def sleep(self) -> None:
        """Release device memory (weights offloaded, KV dropped) if the engine shares its
        device with the trainer; otherwise nothing. Called after every task."""

    @abstractmethod
    def wake(self) -> None:
        """Undo ``sleep``; nothing when awake. Called before ``set_weights``/generating."""

    @property
    @abstractmethod
    def tokenizer(self):
        """The tokenizer (``pad_token_id``, ``eos_token_id``, ``batch_decode``)."""
