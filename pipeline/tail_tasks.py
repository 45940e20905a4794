"""Graph tasks that move a paused tail's KV cache from one generation worker to another.

A chunk (``workers.generate_chunk_task``) leaves its unfinished sequences paused on its
worker under a key. To continue them elsewhere *with* their KV cache:

1. ``export_tail_task(key)`` runs on the source worker; its result, a ``TailKV``
   (``ops/kv_transfer.py``), stays in that worker's memory as a Dask task result;
2. ``adopt_tails_task([that future], new_key, ...)`` is pinned to the target worker; Dask
   fetches its argument from the source worker directly (worker to worker, never through
   the driver), and the task rebuilds the batch there, paused under ``new_key``, together
   with any tails already paused on the target (``local``: PAT's consolidation);
3. ``workers.resume_task(new_key, ...)`` finishes it on the target, as it finishes a tail
   that never moved.

Once step 2 is done the tail lives on the target alone: the driver drops the export's
future and the source may be retired or die without loss. ``set_threads_task`` changes
the torch threads of a worker (reconfiguration: a consolidated tail decodes wider).
"""

from __future__ import annotations

import time

import torch

from rlhfless.ops.kv_transfer import TailKV, export_tail, import_tail
from rlhfless.ops.publish import WeightsRef, require_version

from .workers import _PAUSED, GenSpec, _hf_engine, _worker_name


def _take_paused(key: str) -> TailKV:
    entry = _PAUSED.pop(key, None)
    if entry is None:
        raise KeyError(f"worker {_worker_name()} holds no paused decoding {key!r} "
                       "(never paused here, already moved, or the worker restarted)")
    dec, rows, start = entry
    return export_tail(dec, rows, start)


def export_tail_task(key: str) -> TailKV:
    """On the source worker: the paused decoding ``key`` as a ``TailKV`` (it leaves the
    worker's paused decodings; the result is the only copy until a target adopts it)."""
    return _take_paused(key)


def adopt_tails_task(tails: list[TailKV], key: str, weights: WeightsRef, spec: GenSpec,
                     local: tuple[str, ...] = ()) -> dict:
    """On the target worker: the sequences of ``tails`` (fetched by Dask from the workers
    that exported them) and of this worker's paused decodings ``local``, as one decoding
    paused here under ``key``. Returns the move's facts: bytes and context tokens received,
    seconds from the last export to this task's start (``transfer_s``: scheduling and the
    worker-to-worker fetch) and to rebuild the cache (``rebuild_s``)."""
    arrived = time.time()
    engine, cold = _hf_engine(spec.engine, weights)
    require_version(engine.version, weights.version, f"worker {_worker_name()}")
    own = [_take_paused(k) for k in local]
    dec, rows = import_tail(engine.model, own + list(tails))
    _PAUSED[key] = (dec, rows, min(t.start for t in own + list(tails)))
    exported = max((t.exported_at for t in tails), default=arrived)
    return {"worker": _worker_name(), "sequences": len(rows),
            "bytes": sum(t.nbytes for t in tails),
            "context_tokens": sum(t.context_tokens for t in tails),
            "transfer_s": max(0.0, arrived - exported), "rebuild_s": time.time() - arrived,
            "cold_start_s": cold}


def set_threads_task(threads: int) -> int:
    """Set this worker's torch intra-op threads; returns the previous count."""
    if threads < 1:
        raise ValueError(f"set_threads_task: threads={threads}; allowed: >= 1")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    return before
