"""Requests on a vLLM engine stepped one scheduler step at a time, under a stop rule.

``run_requests`` adds one request per token-id prompt to the in-process ``LLMEngine``
(``LLM.llm_engine``) and steps it, reading each request's output so far (vLLM's default
``RequestOutputKind.CUMULATIVE``) after every step: so a finished request is seen at once
(``on_finish``: an episode's environment step starts while the others decode), and when
the stop rule fires the unfinished requests are aborted and handed back with their tokens
and behaviour logprobs so far. Their KV blocks stay in vLLM's prefix cache until evicted,
so continuing them from prompt + tokens so far is mostly a cache hit. Its phases
(``phases.py``): the steps as decode spans, with the tokens they sampled (vLLM prefills
inside its steps: no prefill spans), and a ``pause`` where the stop rule cut the requests.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .engine_types import StopRule
from .gen_stats import GenerationStats
from .phases import DecodeSpans, record

_REQUEST_IDS = itertools.count()  # request names unique within the process


@dataclass
class Outcome:
    """Per request, in order: (token ids, logprobs, "stop" | "length") so far, and whether
    it finished (the others were aborted by the stop rule)."""

    results: list[tuple[list[int], list[float], str]]
    finished: list[bool]


def tokens_so_far(completion: Any) -> tuple[list[int], list[float], str]:
    """(ids, the sampled tokens' logprobs, finish reason or "length") of a completion so far
    (vLLM's ``CompletionOutput``): a logprob per token, a finished one ends stop or length."""
    tokens = list(completion.token_ids)
    logprobs = [float(step[tok].logprob) for tok, step in zip(tokens, completion.logprobs or [])]
    if len(logprobs) != len(tokens):
        raise RuntimeError("vLLM returned no logprob for some sampled token (logprobs=0)")
    reason = completion.finish_reason or "length"
    if reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a sample with {reason!r}")
    return tokens, logprobs, reason


def run_requests(engine: Any, prompts: list[list[int]], params: list[Any],
                 stats: GenerationStats, stop: StopRule | None = None,
                 on_finish: Callable[[int, tuple[list[int], list[float], str]], None]
                 | None = None,
                 lora_request: Any = None) -> Outcome:
    """Run one request per prompt (token ids, ``params[i]`` a vLLM ``SamplingParams`` with
    n = 1) on ``engine`` until all finish or ``stop`` fires; see the module docstring.
    ``lora_request``: the adapter every request runs with (None: the base model).
    ``on_finish(i, result)``: request ``i`` finished with ``result`` (``tokens_so_far``)."""
    names = [f"rlhfless-{next(_REQUEST_IDS)}" for _ in prompts]
    index = {name: i for i, name in enumerate(names)}
    latest: list[Any] = [None] * len(prompts)
    finished = [False] * len(prompts)
    sampled = [0] * len(prompts)  # tokens of each request so far
    target = len(prompts) if stop is None else math.ceil(stop.until_finished * len(prompts))
    started, spans = time.perf_counter(), DecodeSpans()
    try:
        for name, prompt, sp in zip(names, prompts, params):
            engine.add_request(name, {"prompt_token_ids": prompt}, sp,
                               lora_request=lora_request)
        done = 0
        while done < len(prompts):
            new = 0
            for out in engine.step():
                i = index.get(out.request_id)
                if i is None:
                    continue
                latest[i] = out
                new += len(out.outputs[0].token_ids) - sampled[i]
                sampled[i] = len(out.outputs[0].token_ids)
                if out.finished and not finished[i]:
                    finished[i], done = True, done + 1
                    if on_finish is not None:
                        on_finish(i, tokens_so_far(out.outputs[0]))
            stats.decode_steps += 1
            spans.step(new)
            if done < len(prompts) and stop is not None and (
                    done >= target or stop.interrupted()):
                spans.close()
                now = time.time()
                record("pause", now, now, live=len(prompts) - done, finished=done / len(prompts),
                       by="tau" if done >= target else "interrupted")
                break
    finally:  # stopped, or failed: nothing of ours is left running in the engine
        running = [name for name, f in zip(names, finished) if not f]
        if running:
            engine.abort_request(running)
    stats.decode_seconds += time.perf_counter() - started
    spans.close()
    results = [tokens_so_far(out.outputs[0]) if out is not None else ([], [], "length")
               for out in latest]
    cached = [min(len(p), getattr(out, "num_cached_tokens", 0) or 0) if out is not None else 0
              for p, out in zip(prompts, latest)]
    stats.decode_tokens += sum(len(r[0]) for r in results)
    stats.prefill_tokens += sum(len(p) for p in prompts) - sum(cached)
    stats.prefill_reused_tokens += sum(cached)
    stats.prefill_requests += len(prompts)
    return Outcome(results, finished)
