"""The transformers engine (``HFBackend``, our own decode loop).

``HFBackend`` implements the engine protocol (``protocol.py``, where the call order is) over
a transformers causal LM: ``generate`` prefills shared prefixes once per call
(``generate.py``; the prefix KV is dropped with the call, so no cache outlives a weight
update); ``generate_until`` keeps the cut rows' decoding, KV cache and all, as its paused
handle, which ``resume`` finishes in place or ``export_paused`` / ``adopt`` move to another
worker (``kv_transfer.py``); ``decode_turns`` keeps each conversation's KV between turns
(``turns.py``). It is not colocated: sleeping is not needed. ``load_causal_lm`` is the load
the trainer shares. Engines are made by name from ``registry.py``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from .engine_types import (
    TAIL_ACTIONS,
    Chunk,
    EngineSpec,
    SamplingParams,
    StopRule,
    Turn,
    WeightsRef,
)
from .gen_stats import GenerationStats
from .generate import (
    Decoding,
    generate_rollouts,
    prefill_continuations,
    prefill_prompts,
    run_decoding,
)
from .kv_transfer import (
    TailKV,
    export_tail,
    import_tail,
    kv_bytes_per_token,
    recompute_tail,
    split_tail,
)
from .lora import LoraSpec, add_adapters
from .protocol import GenerationBackend
from .publish import load_weights
from .rows import cut_rows, expand_samples, prefix_lens_of, rollouts_table, row_keys
from .turns import decode_turns

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


def load_causal_lm(model_path: str | Path, device: str = "auto", threads: int = 1,
                   lora: LoraSpec | None = None, dtype: str = "auto"):
    """(model in eval mode, tokenizer) from a Hugging Face directory: bf16 on CUDA, fp32 on
    CPU unless ``dtype`` names another, torch pinned to ``threads``, LoRA adapters added."""
    hf_logging.disable_progress_bar()
    torch.set_num_threads(threads)
    where = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=resolve_dtype(dtype, where)).to(where).eval()
    if lora is not None:
        add_adapters(model, lora)
    return model, AutoTokenizer.from_pretrained(model_path)


@dataclass
class _Paused:
    """A decoding ``generate_until`` cut: the batch (KV cache and all), a row per sequence,
    and when its generation started."""

    dec: Decoding
    rows: pa.Table
    start: float


class HFBackend(GenerationBackend):
    """transformers model + our decode loop; see the module docstring."""

    exports_kv = True
    tail_actions = frozenset(TAIL_ACTIONS)
    dtypes = DTYPES

    def __init__(self, model_path: str | Path, device: str = "auto", threads: int = 1,
                 lora: LoraSpec | None = None, dtype: str = "auto") -> None:
        self.model_path, self.device_name, self.threads = str(model_path), device, threads
        self.width = 1  # times ``threads`` it decodes with (``widen``)
        self.dtype_name = dtype
        self.lora = lora  # adapters on the model (lora.py); published versions carry them
        self.model: torch.nn.Module | None = None
        self._tokenizer = None

    @classmethod
    def of_model(cls, model: torch.nn.Module, tokenizer, version: int = 0) -> HFBackend:
        """An engine over a model already loaded (tests, benches), at ``version``."""
        engine = cls(getattr(model, "name_or_path", "") or "<in memory>")
        engine.model, engine._tokenizer, engine.version = model, tokenizer, version
        return engine

    @classmethod
    def kv_bytes_per_token(cls, spec: EngineSpec) -> float:
        dtype = resolve_dtype(spec.dtype, resolve_device(spec.device))
        return kv_bytes_per_token(spec.model_path, torch.empty(0, dtype=dtype).element_size())

    def load(self) -> None:
        started = time.perf_counter()
        self.model, self._tokenizer = load_causal_lm(self.model_path, self.device_name,
                                                      self.threads, self.lora, self.dtype_name)
        self.load_seconds = time.perf_counter() - started

    @property
    def tokenizer(self):
        return self._tokenizer

    def widen(self, width: int) -> int:
        """``width`` times the worker's torch threads (1: its own); the width before."""
        if width < 1:
            raise ValueError(f"widen: width={width}; allowed: >= 1")
        before, self.width = self.width, width
        torch.set_num_threads(self.threads * width)
        return before

    @property
    def max_context(self) -> int | None:
        return getattr(self._loaded().config, "max_position_embeddings", None)

    def set_weights(self, ref: WeightsRef) -> None:
        load_weights(self._loaded(), ref)
        self.version = ref.version
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Nothing to reset: prefix KV lives only inside one call."""

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

    def generate_until(self, prompts: pa.Table, n_samples: int, params: SamplingParams,
                       stop: StopRule, *, worker: str = "local",
                       share_prefixes: bool = True) -> Chunk:
        model, tok = self._loaded(), self._tokenizer
        stats, start = GenerationStats(), time.time()
        rows = expand_samples(prompts, n_samples)
        dec = prefill_prompts(model, prompts.column("prompt_ids").to_pylist(), n_samples,
                              params, tok.pad_token_id, prefix_lens_of(prompts, share_prefixes),
                              stats, row_keys(params.seed, rows))
        run_decoding(model, dec, params, tok.eos_token_id, stats, stop.until_finished,
                     pause=stop.interrupted)
        done, cut = cut_rows(rows, dec.results(), dec.live.tolist(), tok,
                             policy_version=self.version, worker=worker, start=start)
        return Chunk(done, cut, stats, _Paused(dec, rows, start) if len(dec.live) else None)

    def resume(self, paused: _Paused, params: SamplingParams, *,
               worker: str = "local") -> tuple[pa.Table, GenerationStats]:
        dec, stats = paused.dec, GenerationStats()
        tail = dec.live.tolist()
        run_decoding(self._loaded(), dec, params, self._tokenizer.eos_token_id, stats)
        results = dec.results()
        table = rollouts_table(paused.rows.take(pa.array(tail, pa.int64())),
                               [results[i] for i in tail], self._tokenizer,
                               policy_version=self.version, worker=worker,
                               start=paused.start, end=time.time())
        return table, stats

    def continue_rows(self, cut: pa.Table, params: SamplingParams, *,
                      worker: str = "local") -> tuple[pa.Table, GenerationStats]:
        model, tok = self._loaded(), self._tokenizer
        stats, start = GenerationStats(), time.time()
        dec = prefill_continuations(model, cut, params, tok.pad_token_id, stats)
        run_decoding(model, dec, params, tok.eos_token_id, stats)
        rows = cut.drop_columns(["partial_ids", "partial_logprobs"])
        return rollouts_table(rows, dec.results(), tok, policy_version=self.version,
                              worker=worker, start=start, end=time.time()), stats

    def export_paused(self, paused: _Paused, positions: list[int] | None = None) -> TailKV:
        if positions is None:
            return export_tail(paused.dec, paused.rows, paused.start)
        return split_tail(paused.dec, paused.rows, paused.start, positions)

    def adopt(self, tails: list[TailKV], recompute: pa.Table | None, params: SamplingParams,
              stats: GenerationStats) -> _Paused:
        model = self._loaded()
        tails = list(tails)
        if recompute is not None and len(recompute):
            tails.append(recompute_tail(model, recompute, params,
                                        self._tokenizer.pad_token_id, stats))
        dec, rows = import_tail(model, tails)
        return _Paused(dec, rows, min(t.start for t in tails))

    def decode_turns(self, turns: list[Turn], params: SamplingParams,
                     stats: GenerationStats, *, keep_cache: bool = True,
                     on_leave=None) -> None:
        decode_turns(self._loaded(), self._tokenizer, turns, params, stats,
                     keep_cache=keep_cache, on_leave=on_leave)

    def step_seconds(self, batch: int, steps: int, prompt_tokens: int) -> float:
        model, params = self._loaded(), SamplingParams(max_new_tokens=steps, greedy=True)
        prompts = [[(7 * i + j) % 200 + 10 for j in range(prompt_tokens)] for i in range(batch)]
        stats = GenerationStats()
        dec = prefill_prompts(model, prompts, 1, params, self._tokenizer.pad_token_id, None,
                              stats)
        run_decoding(model, dec, params, -1, stats)
        return stats.decode_seconds / max(1, stats.decode_steps)

    def close(self) -> None:
        self.model = None

    def _loaded(self) -> torch.nn.Module:
        if self.model is None:
            raise RuntimeError(f"HFBackend({self.model_path}): call load() first")
        return self.model
