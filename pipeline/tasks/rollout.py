"""Generation tasks, on the generation pool (resource ``GEN``).

Each generation worker holds one engine (``_ENGINE``: a backend of ``ops/engine/backend.py`` at some
policy version) and the decodings paused on it (``PAUSED``). ``generate_task`` generates a
shard whole; under the elastic policy ``generate_chunk_task`` stops at a completion fraction
and leaves the rest paused, which ``resume_task`` finishes here or ``continue_task``
continues on another worker (its prefix recomputed; ``tail_tasks.py`` moves it with its KV
cache). Every task returns its rows beside their generation statistics (``Generated``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pyarrow as pa

from rlhfless.ops.engine.backend import GenerationBackend, HFBackend, make_backend
from rlhfless.ops.engine.gen_stats import Generated, GenerationStats
from rlhfless.ops.engine.generate import (
    Decoding,
    SamplingParams,
    expand_samples,
    prefill_continuations,
    prefill_prompts,
    prefix_lens_of,
    rollouts_table,
    row_keys,
    run_decoding,
)
from rlhfless.ops.engine.publish import WeightsRef, require_version
from rlhfless.ops.rollouts.episode import EpisodeParams, run_episodes

from .engines import EngineSpec, worker_name


@dataclass(frozen=True)
class GenSpec:
    engine: EngineSpec
    n_samples: int
    sampling: SamplingParams
    share_prefixes: bool = True
    max_staleness: int = 0  # async: versions the engine may lag the consuming trainer
    episodes: EpisodeParams | None = None  # multi-turn rollouts against an environment


_ENGINE: dict[str, GenerationBackend] = {}
PAUSED: dict[str, tuple[Decoding, pa.Table, float]] = {}  # chunk key -> paused decoding


def _generation_engine(spec: EngineSpec,
                       weights: WeightsRef) -> tuple[GenerationBackend, float]:
    """This worker's engine (awake) at ``weights.version``, and the cold-start seconds paid
    now. The call order is the backend protocol's (ops/engine/backend.py)."""
    cold = 0.0
    engine = _ENGINE.get(spec.model_path)
    if engine is None:
        engine = make_backend(spec.backend, spec.model_path, spec.device, spec.threads,
                              colocate=spec.colocate, lora=spec.lora, dtype=spec.dtype,
                              gpu_memory_utilization=spec.gpu_memory_utilization)
        engine.load()
        _ENGINE[spec.model_path] = engine
        cold = engine.load_seconds
    engine.wake()
    if engine.version != weights.version:
        engine.set_weights(weights)
    return engine, cold


def hf_engine(spec: EngineSpec, weights: WeightsRef) -> tuple[HFBackend, float]:
    """The engine of a task that drives the decode loop itself (chunked generation)."""
    engine, cold = _generation_engine(spec, weights)
    if not isinstance(engine, HFBackend):
        raise TypeError(f"chunked generation (policy = 'elastic') needs backend 'hf', "
                        f"not {spec.backend!r}")
    return engine, cold


def generate_task(shard: pa.Table, weights: WeightsRef, spec: GenSpec, seed: int,
                  target_version: int | None = None) -> Generated:
    """Rollouts of one shard, beside the statistics of their generation.
    ``target_version``: the trainer version that will consume them (default: ``weights``'),
    which ``weights`` may lag by up to ``spec.max_staleness`` versions."""
    engine, cold = _generation_engine(spec.engine, weights)
    need = weights.version if target_version is None else target_version
    require_version(engine.version, need, f"worker {worker_name()}", spec.max_staleness)
    params = SamplingParams(**{**spec.sampling.__dict__, "seed": seed})
    if spec.episodes is not None:
        return _episodes(engine, shard, spec, params, cold)
    table, stats = engine.generate(shard, spec.n_samples, params, worker=worker_name(),
                                   share_prefixes=spec.share_prefixes)
    engine.sleep()  # colocated engines free the device for the trainer
    return _generated(table, stats, cold)


def _generated(table: pa.Table, stats: GenerationStats, cold: float) -> Generated:
    """``table`` beside ``stats``, with the cold start paid and the generation seconds."""
    stats.cold_start_s = cold
    stats.gen_seconds = stats.prefill_seconds + stats.decode_seconds
    return Generated(table, stats)


def _episodes(engine: GenerationBackend, shard: pa.Table, spec: GenSpec,
              params: SamplingParams, cold: float) -> Generated:
    """Multi-turn rollouts of a shard (``ops/rollouts/episode.py``); generation seconds and
    environment seconds are reported apart (``gen_seconds``, ``env_seconds``)."""
    if not isinstance(engine, HFBackend):
        raise TypeError("multi-turn rollouts need backend 'hf'")
    stats = GenerationStats()
    table, episodes = run_episodes(engine.model, engine.tokenizer, shard, spec.n_samples,
                                   params, spec.episodes, policy_version=engine.version,
                                   worker=worker_name(), stats=stats)
    stats.episodes = episodes
    return _generated(table, stats, cold)


# ---- chunked generation (elastic policy): cut at tau, then resume here or migrate ----

def _finished_and_cut(dec: Decoding, rows: pa.Table, engine: HFBackend, start: float,
                      stats: GenerationStats, cold: float) -> dict:
    """Rollouts of the sequences that left the batch, and the cut (unfinished) ones with
    their tokens so far (``partial_ids``, ``partial_logprobs``) for a continuation."""
    unfinished = dec.live.tolist()
    pending = set(unfinished)
    done = [i for i in range(len(rows)) if i not in pending]
    results = dec.results()
    table = rollouts_table(rows.take(pa.array(done, pa.int64())), [results[i] for i in done],
                           engine.tokenizer, policy_version=engine.version,
                           worker=worker_name(), start=start, end=time.time())
    cut = rows.take(pa.array(unfinished, pa.int64()))
    cut = cut.append_column("partial_ids", pa.array([results[i][0] for i in unfinished],
                                                    pa.list_(pa.int32())))
    cut = cut.append_column("partial_logprobs", pa.array([results[i][1] for i in unfinished],
                                                         pa.list_(pa.float32())))
    return {"done": _generated(table, stats, cold), "cut": cut}


class PauseFlag:
    """``run_decoding``'s ``pause``: true once the Dask ``Event`` named ``name`` is set (by
    the driver, when another worker ran out of work); the scheduler is asked at most every
    ``every_s`` seconds, so a fast decode step does not wait on it each time."""

    def __init__(self, name: str, every_s: float = 0.02) -> None:
        from distributed import Event

        self.event, self.every_s, self.asked = Event(name), every_s, 0.0

    def __call__(self) -> bool:
        now = time.perf_counter()
        if now - self.asked < self.every_s:
            return False
        self.asked = now
        return self.event.is_set()


def generate_chunk_task(shard: pa.Table, weights: WeightsRef, spec: GenSpec, seed: int,
                        until_finished: float, key: str, pause_event: str | None = None) -> dict:
    """Generate a shard until ``until_finished`` of its sequences are done, or until the
    Dask event ``pause_event`` is set; the rest stay paused on this worker under ``key`` (KV
    cache and all) until ``resume_task`` or ``drop_task``. Returns ``{"done": rollouts,
    "cut": unfinished rows}``."""
    engine, cold = hf_engine(spec.engine, weights)
    require_version(engine.version, weights.version, f"worker {worker_name()}")
    params = SamplingParams(**{**spec.sampling.__dict__, "seed": seed})
    if spec.episodes is not None:  # episodes run whole: there is no tail to cut
        return {"done": _episodes(engine, shard, spec, params, cold), "cut": shard.slice(0, 0)}
    stats, start = GenerationStats(), time.time()
    rows = expand_samples(shard, spec.n_samples)
    tok = engine.tokenizer
    dec = prefill_prompts(engine.model, shard.column("prompt_ids").to_pylist(), spec.n_samples,
                          params, tok.pad_token_id, prefix_lens_of(shard, spec.share_prefixes),
                          stats, row_keys(seed, rows))
    run_decoding(engine.model, dec, params, tok.eos_token_id, stats, until_finished,
                 pause=None if pause_event is None else PauseFlag(pause_event))
    out = _finished_and_cut(dec, rows, engine, start, stats, cold)
    if len(dec.live):
        PAUSED[key] = (dec, rows, start)
    return out


def resume_task(key: str, weights: WeightsRef, spec: GenSpec) -> Generated:
    """Finish the paused decoding ``key`` here, with its KV cache (the *stay* side)."""
    dec, rows, start = PAUSED.pop(key)
    engine, _ = hf_engine(spec.engine, weights)
    require_version(engine.version, weights.version, f"worker {worker_name()}")
    tail = dec.live.tolist()
    stats = GenerationStats()
    run_decoding(engine.model, dec, spec.sampling, engine.tokenizer.eos_token_id, stats)
    results = dec.results()
    table = rollouts_table(rows.take(pa.array(tail, pa.int64())), [results[i] for i in tail],
                           engine.tokenizer, policy_version=engine.version,
                           worker=worker_name(), start=start, end=time.time())
    return _generated(table, stats, 0.0)


def drop_task(key: str) -> bool:
    """Forget the paused decoding ``key`` (its tail was migrated elsewhere)."""
    return PAUSED.pop(key, None) is not None


def continue_task(cut: pa.Table, weights: WeightsRef, spec: GenSpec, seed: int) -> Generated:
    """Continue sequences cut on another worker, recomputing their prefix (the *move*
    side of cut-and-migrate)."""
    engine, cold = hf_engine(spec.engine, weights)
    require_version(engine.version, weights.version, f"worker {worker_name()}")
    params = SamplingParams(**{**spec.sampling.__dict__, "seed": seed})
    stats, start = GenerationStats(), time.time()
    tok = engine.tokenizer
    dec = prefill_continuations(engine.model, cut, params, tok.pad_token_id, stats)
    run_decoding(engine.model, dec, params, tok.eos_token_id, stats)
    rows = cut.drop_columns(["partial_ids", "partial_logprobs"])
    table = rollouts_table(rows, dec.results(), tok, policy_version=engine.version,
                           worker=worker_name(), start=start, end=time.time())
    return _generated(table, stats, cold)
