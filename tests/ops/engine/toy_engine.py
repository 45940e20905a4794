"""A toy generation engine, written as a user would write one: a file of its own and one
``register_engine`` line. It samples token by token with a whole forward pass of the
transformers model per token (no KV cache, so nothing to export: a moved tail recomputes),
from the temperature-scaled softmax (``top_p = 1`` only), each sequence's k-th token drawn
from its own uniform (``seeds.uniforms``) as the protocol asks, so a draw does not depend on
the batch. Slow, and small enough to read: what the conformance suite needs of an engine."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhfless.ops.engine.engine_types import Chunk, SamplingParams, StopRule, Turn, WeightsRef
from rlhfless.ops.engine.gen_stats import GenerationStats
from rlhfless.ops.engine.protocol import GenerationBackend
from rlhfless.ops.engine.publish import load_weights
from rlhfless.ops.engine.rows import cut_rows, expand_samples, rollouts_table, row_keys
from rlhfless.ops.engine.seeds import uniforms

Result = tuple[list[int], list[float], str]


class ToyEngine(GenerationBackend):
    dtypes = ("auto", "float32")

    def __init__(self, model_path: str, threads: int = 1) -> None:
        self.model_path, self.threads = model_path, threads
        self.model, self._tokenizer = None, None

    def load(self) -> None:
        started = time.perf_counter()
        torch.set_num_threads(self.threads)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path,
                                                          dtype=torch.float32).eval()
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.load_seconds = time.perf_counter() - started

    def close(self) -> None:
        self.model = None

    def set_weights(self, ref: WeightsRef) -> None:
        load_weights(self.model, ref)
        self.version = ref.version

    def reset_prefix_cache(self) -> None:
        """No cache is kept."""

    def sleep(self) -> None:
        """Never colocated."""

    def wake(self) -> None:
        """Never asleep."""

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_context(self) -> int | None:
        return self.model.config.max_position_embeddings

    @torch.inference_mode()
    def _decode(self, contexts: list[list[int]], budgets: list[int], keys: np.ndarray,
                params: SamplingParams, stats: GenerationStats, done: list[Result | None],
                stop: StopRule | None = None, until: int | None = None) -> list[Result]:
        """Extend every sequence one token per step until each ends (EOS or its budget), or
        until ``until`` of them ended or ``stop`` interrupts; a sequence's k-th draw is its
        uniform at counter k (``done[i]``: its tokens so far, None when it has none)."""
        if params.top_p < 1:
            raise ValueError("ToyEngine samples at top_p = 1 only")
        out = [list(r) if r else ([], [], "length") for r in done]
        live = [i for i in range(len(contexts)) if len(out[i][0]) < budgets[i]]
        started = time.perf_counter()
        while live and (until is None or len(contexts) - len(live) < until):
            if stop is not None and stop.interrupted():
                break
            for i in list(live):
                ids = torch.tensor([contexts[i] + out[i][0]])
                logits = self.model(input_ids=ids).logits[0, -1]
                logprobs = torch.log_softmax(logits.double() / params.temperature, -1)
                k = len(out[i][0])
                if params.greedy:
                    token = int(logprobs.argmax())
                else:
                    u = uniforms(keys[i:i + 1], np.array([k], dtype=np.uint64))[0]
                    cdf = logprobs.exp().cumsum(0)
                    token = min(int(torch.searchsorted(cdf, cdf[-1] * u)), len(cdf) - 1)
                out[i][0].append(token)
                out[i][1].append(float(logprobs[token]))
                if token == self._tokenizer.eos_token_id or len(out[i][0]) >= budgets[i]:
                    out[i] = (out[i][0], out[i][1],
                              "stop" if token == self._tokenizer.eos_token_id else "length")
                    live.remove(i)
            stats.decode_steps += 1
        stats.decode_seconds += time.perf_counter() - started
        return [tuple(r) for r in out]

    def _rows(self, rows: pa.Table, params: SamplingParams, stats: GenerationStats,
              stop: StopRule | None = None, until: int | None = None):
        """(results, unfinished positions) of ``rows`` (with ``partial_ids`` if cut)."""
        contexts = rows.column("prompt_ids").to_pylist()
        stats.prefill_tokens += sum(map(len, contexts))
        partial = ([None] * len(rows) if "partial_ids" not in rows.column_names else
                   [(i, lp, "length") for i, lp in zip(rows.column("partial_ids").to_pylist(),
                                                       rows.column("partial_logprobs").to_pylist())])
        budgets = [params.max_new_tokens] * len(rows)
        results = self._decode(contexts, budgets, row_keys(params.seed, rows), params, stats,
                               partial, stop, until)
        eos = self._tokenizer.eos_token_id
        unfinished = [i for i, (ids, _, _) in enumerate(results)
                      if len(ids) < budgets[i] and (not ids or ids[-1] != eos)]
        return results, unfinished

    def generate(self, prompts, n_samples, params, *, worker="local", share_prefixes=True):
        rows, stats, start = expand_samples(prompts, n_samples), GenerationStats(), time.time()
        results, _ = self._rows(rows, params, stats)
        return rollouts_table(rows, results, self._tokenizer, policy_version=self.version,
                              worker=worker, start=start, end=time.time()), stats

    def generate_until(self, prompts, n_samples, params, stop, *, worker="local",
                       share_prefixes=True) -> Chunk:
        rows, stats, start = expand_samples(prompts, n_samples), GenerationStats(), time.time()
        until = int(np.ceil(stop.until_finished * len(rows)))
        results, unfinished = self._rows(rows, params, stats, stop, until)
        done, cut = cut_rows(rows, results, unfinished, self._tokenizer,
                             policy_version=self.version, worker=worker, start=start)
        return Chunk(done, cut, stats, paused=cut if len(cut) else None)

    def resume(self, paused, params, *, worker="local"):
        return self.continue_rows(paused, params, worker=worker)

    def continue_rows(self, cut, params, *, worker="local"):
        stats, start = GenerationStats(), time.time()
        results, _ = self._rows(cut, params, stats)
        rows = cut.drop_columns(["partial_ids", "partial_logprobs"])
        return rollouts_table(rows, results, self._tokenizer, policy_version=self.version,
                              worker=worker, start=start, end=time.time()), stats

    def decode_turns(self, turns: list[Turn], params, stats, *, keep_cache=True,
                     on_leave=None) -> None:
        keys = np.array([t.key for t in turns], dtype=np.uint64)
        results = self._decode([t.context for t in turns], [t.budget for t in turns], keys,
                               params, stats, [None] * len(turns))
        for i, (turn, result) in enumerate(zip(turns, results)):
            turn.result = result
            if on_leave is not None:
                on_leave(i, result[0])

    def step_seconds(self, batch: int, steps: int, prompt_tokens: int) -> float:
        stats = GenerationStats()
        params = SamplingParams(max_new_tokens=steps, greedy=True)
        self._decode([[0] * prompt_tokens] * batch, [steps] * batch,
                     np.zeros(batch, dtype=np.uint64), params, stats, [None] * batch)
        return stats.decode_seconds / max(1, stats.decode_steps)
