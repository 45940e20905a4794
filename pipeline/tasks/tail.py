"""Graph tasks that move a paused tail's KV cache from one generation worker to another.

A chunk (``rollout.generate_chunk_task``) leaves its unfinished sequences paused on its
worker under a key. To continue them elsewhere *with* their KV cache:

1. ``export_tail_task(key)`` runs on the source worker; its result, the engine's exported
   tail (``TailKV`` of ``ops/engine/kv_transfer.py`` on our engine), stays in that
   worker's memory as a Dask task result;
2. ``adopt_tails_task([that future], new_key, ...)`` is pinned to the target worker; Dask
   fetches its argument from the source worker directly (worker to worker, never through
   the driver), and the task rebuilds the batch there, paused under ``new_key``, together
   with any tails already paused on the target (``local``: PAT's consolidation);
3. ``rollout.resume_task(new_key, ...)`` finishes it on the target, as it finishes a tail
   that never moved.

A tail split over several targets is cut on the source first (``take_tail_task``: each
target fetches only its part); a worker that sheds part of its tail and decodes the rest
itself cuts it in place (``split_tail_task``); ``adopt_tails_task`` can instead recompute
cut rows' context on the target (``recompute``), so both paths of a move end in one paused
decoding there, which ``resume_adopted_task`` finishes once the adoption is done.
``move_actual_s`` reads a move's actual seconds off the adoption's facts (what
``tail_cost.KvCosts`` learns from).

Once step 2 is done the tail lives on the target alone: the driver drops the export's
future and the source may be retired or die without loss. ``resume_wide_task`` finishes a
consolidated tail on a wider engine (reconfiguration: ``GenerationBackend.widen``, more
threads on a CPU, a larger TP on GPUs), ``set_threads_task`` widens a worker, and
``profile_steps_task`` measures its decode step time by batch and threads. Nothing here
imports torch: an emulated worker runs these tasks too.
"""

from __future__ import annotations

import time
from typing import Any

import pyarrow as pa
from distributed import Reschedule, get_client, get_worker

from rlhfless.ops.engine.engine_types import EngineSpec, WeightsRef, require_version
from rlhfless.ops.engine.gen_stats import Generated, GenerationStats

from .engines import worker_name
from .rollout import PAUSED, GenSpec, generation_engine, resume_task, seeded, worker_engine


class TailLost(KeyError):
    """A paused decoding this worker was asked for is not here: never paused here, already
    moved, or its worker died and the task that held it was rerun elsewhere."""


def _in_cluster(address: str, dask_scheduler=None) -> bool:
    """On the scheduler: is the worker at ``address`` still there?"""
    return address in dask_scheduler.workers


def _kv_engine(spec: EngineSpec, weights: WeightsRef):
    """This worker's engine at ``weights`` (awake), which must keep exportable KV."""
    engine, cold, _ = generation_engine(spec, weights)
    require_version(engine.version, weights.version, f"worker {worker_name()}")
    if not engine.exports_kv:
        raise TypeError(f"backend {spec.backend!r} keeps no exportable KV cache: its tails "
                        "move by recompute (continue_task)")
    return engine, cold


def _take_paused(key: str, source: str | None = None) -> Any:
    """The paused decoding ``key`` of this worker, exported. ``source``: the address of the
    worker it was paused on, for a task pinned there loosely (so that a dead source's task
    runs elsewhere and says ``TailLost``): a task that work stealing moved off a source
    still alive goes back to the scheduler (``Reschedule``), which sends it to the source."""
    entry = PAUSED.pop(key, None)
    if entry is None:
        if source is not None and source != get_worker().address \
                and get_client().run_on_scheduler(_in_cluster, source):
            raise Reschedule()
        raise TailLost(f"worker {worker_name()} holds no paused decoding {key!r} "
                       "(never paused here, already moved, or the worker restarted)")
    return worker_engine().export_paused(entry)


def split_tail_task(key: str, positions: list[int], source: str | None = None) -> Any:
    """On the source worker (its address ``source``, as ``_take_paused``'s): the sequences
    at ``positions`` of the paused decoding ``key`` as a tail; the others stay paused
    under ``key`` (all moved: ``key`` is gone)."""
    entry = PAUSED.get(key)
    if entry is None or len(positions) == len(entry.rows):
        return _take_paused(key, source)
    return worker_engine().export_paused(entry, positions)


def export_tail_task(key: str, source: str | None = None) -> Any:
    """On the source worker (its address ``source``, as ``_take_paused``'s): the paused
    decoding ``key`` as a tail (it leaves the worker's paused decodings; the result
    is the only copy until a target adopts it)."""
    return _take_paused(key, source)


def adopt_tails_task(tails: list[Any], key: str, weights: WeightsRef, spec: GenSpec,
                     local: tuple[str, ...] = (), recompute: pa.Table | None = None,
                     seed: int | None = None) -> dict:
    """On the target worker: the sequences of ``tails`` (fetched by Dask from the workers
    that exported them), of this worker's paused decodings ``local`` and of the cut rows
    ``recompute`` (their context prefilled here, their draws keyed by the ``seed`` of the
    chunk that cut them), as one decoding paused here under ``key``.
    Returns the move's facts: bytes and context tokens received, seconds from the last
    export to this task's start (``transfer_s``: scheduling and the worker-to-worker
    fetch), to rebuild the cache (``rebuild_s``) and to recompute (``recompute_s``). An
    engine that computes nothing (the emulated one) times its KV landing on its own clock
    (``GenerationStats.kv_load_seconds``): that is ``rebuild_s``, with no transfer apart."""
    arrived = time.time()
    engine, cold = _kv_engine(spec.engine, weights)
    own = [_take_paused(k) for k in local]
    stats = GenerationStats()
    params = spec.sampling if seed is None else seeded(spec, seed)
    PAUSED[key] = paused = engine.adopt(own + list(tails), recompute, params, stats)
    exported = max((t.exported_at for t in tails), default=arrived)
    own_clock = not engine.computes
    return {"worker": worker_name(), "key": key, "sequences": len(paused.rows),
            "bytes": sum(t.nbytes for t in tails), "export_s": sum(t.export_s for t in tails),
            "context_tokens": sum(t.context_tokens for t in tails),
            "transfer_s": 0.0 if own_clock else max(0.0, arrived - exported),
            "rebuild_s": stats.kv_load_seconds if own_clock
            else time.time() - arrived - stats.prefill_seconds,
            "recompute_s": stats.prefill_seconds, "recompute_tokens": stats.prefill_tokens,
            "cold_start_s": cold}


def take_tail_task(tail: Any, positions: list[int]) -> Any:
    """On the source worker (where ``tail`` was exported): the part of it one target gets."""
    return tail.take(positions)


def resume_adopted_task(facts: dict, weights: WeightsRef, spec: GenSpec) -> Generated:
    """On the target: finish the decoding ``adopt_tails_task`` paused here (its ``facts``,
    which make this task wait for the adoption)."""
    return resume_task(facts["key"], weights, spec)


def resume_wide_task(facts: dict, weights: WeightsRef, spec: GenSpec,
                     threads: int) -> Generated:
    """On a reconfiguration's target: finish the consolidated decoding that
    ``adopt_tails_task`` paused here on the engine widened to ``threads`` (the live
    workers' threads together: ``GenerationBackend.widen``), then narrow it back."""
    before = set_threads_task(threads, spec.engine)
    try:
        return resume_adopted_task(facts, weights, spec)
    finally:
        worker_engine().widen(before)


def move_actual_s(path: str, facts: dict) -> float:
    """The actual seconds of a move's context reaching its target, from the adoption's
    ``facts``: export, scheduling and fetch, rebuild for a transfer; the prefill for a
    recomputation."""
    if path == "transfer":
        return facts["export_s"] + facts["transfer_s"] + facts["rebuild_s"]
    return facts["recompute_s"]


def set_threads_task(threads: int, spec: EngineSpec) -> int:
    """Widen this worker's engine (of ``spec``) to ``threads`` threads in all (a multiple of
    its own: ``GenerationBackend.widen``); returns the width before."""
    if threads < spec.threads or threads % spec.threads:
        raise ValueError(f"set_threads_task: threads={threads}; allowed: a multiple of the "
                         f"worker's own {spec.threads}")
    return worker_engine().widen(threads // spec.threads)


def profile_steps_task(spec: GenSpec, weights: WeightsRef, batches: tuple[int, ...],
                       threads: tuple[int, ...], steps: int = 16, prompt_tokens: int = 48,
                       repeats: int = 5) -> dict[tuple[int, int], list[float]]:
    """Decode step seconds of this worker's engine by (batch, threads), ``repeats`` samples
    each (``GenerationBackend.step_seconds``). Each thread count gets one untimed warm-up
    decode first (its thread pool starts); the repeats then cycle through every (threads,
    batch), so a burst of outside load lands on all of them alike. The engine is narrowed
    back to its own width afterwards."""
    engine, _, _ = generation_engine(spec.engine, weights)
    own = spec.engine.threads

    def step_seconds(batch: int) -> float:
        return engine.step_seconds(batch, steps, prompt_tokens)

    out: dict[tuple[int, int], list[float]] = {(b, t): [] for t in threads for b in batches}
    before = engine.widen(1)
    try:
        for t in threads:
            engine.widen(t // own)
            step_seconds(max(batches))
        for _ in range(repeats):
            for t in threads:
                engine.widen(t // own)
                for b in batches:
                    out[(b, t)].append(step_seconds(b))
    finally:
        engine.widen(before)
    return out
