"""Generation tasks, on the generation pool (resource ``GEN``).

Each generation worker holds one engine (``_ENGINE``: any engine of the protocol,
``ops/engine/protocol.py``, at some policy version) and the chunks paused on it
(``PAUSED``: the engine's own handles). ``generate_task`` generates a shard whole; under the
elastic policy ``generate_chunk_task`` stops at a completion fraction and leaves the rest
paused, which ``resume_task`` finishes here or ``continue_task`` continues on another worker
(its prefix recomputed; ``tail.py`` moves it with its KV cache where the engine can).
Every task returns its rows beside their generation statistics (``Generated``), and drives
its engine through the protocol alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa

from rlhfless.ops.engine.engine_types import (
    EngineSpec,
    SamplingParams,
    StopRule,
    WeightsRef,
    require_version,
)
from rlhfless.ops.engine.gen_stats import Generated, GenerationStats
from rlhfless.ops.engine.phases import record
from rlhfless.ops.engine.protocol import GenerationBackend
from rlhfless.ops.engine.registry import make_engine
from rlhfless.ops.rollouts.agent import AgentParams, run_agent_episodes
from rlhfless.ops.rollouts.episode import EpisodeParams, run_episodes

from .engines import engine_ram_bytes, worker_name
from .weight_store import local_weights


@dataclass(frozen=True)
class GenSpec:
    engine: EngineSpec
    n_samples: int
    sampling: SamplingParams
    share_prefixes: bool = True
    max_staleness: int = 0  # async: versions the engine may lag the consuming trainer
    episodes: EpisodeParams | None = None  # multi-turn rollouts against an environment
    agent: AgentParams | None = None  # agent episodes against the worker's endpoint


_ENGINE: dict[str, GenerationBackend] = {}
PAUSED: dict[str, Any] = {}  # chunk key -> the engine's paused handle (``Chunk.paused``)


def generation_engine(spec: EngineSpec,
                      weights: WeightsRef) -> tuple[GenerationBackend, float, float]:
    """This worker's engine (awake) at ``weights.version``, and the seconds paid now: its
    cold start, and getting the version into it (fetched first where a worker holds it).
    The call order is the engine protocol's (ops/engine/protocol.py); the cold start and the
    fetch are phases of the task (``ops/engine/phases.py``)."""
    cold = fetch = 0.0
    engine = _ENGINE.get(spec.model_path)
    if engine is None:
        t0 = time.time()
        engine = make_engine(spec, engine_ram_bytes())
        engine.load()
        _ENGINE[spec.model_path] = engine
        cold = engine.load_seconds
        record("cold_start", t0, time.time(), load_s=cold)
    engine.wake()
    if engine.version != weights.version:
        started, t0 = time.perf_counter(), time.time()
        engine.set_weights(local_weights(weights))
        fetch = time.perf_counter() - started
        record("weight_fetch", t0, time.time(), version=weights.version,
               from_worker=weights.holder is not None, from_url=weights.remote is not None)
    return engine, cold, fetch


def worker_engine() -> GenerationBackend:
    """The engine this worker holds (the one that paused its chunks)."""
    if len(_ENGINE) != 1:
        raise RuntimeError(f"worker {worker_name()} holds {len(_ENGINE)} engines, not one")
    return next(iter(_ENGINE.values()))


def seeded(spec: GenSpec, seed: int) -> SamplingParams:
    """The run's sampling parameters under a task's generation ``seed``."""
    return replace(spec.sampling, seed=seed)


def generate_task(shard: pa.Table, weights: WeightsRef, spec: GenSpec, seed: int,
                  target_version: int | None = None) -> Generated:
    """Rollouts of one shard, beside the statistics of their generation.
    ``target_version``: the trainer version that will consume them (default: ``weights``'),
    which ``weights`` may lag by up to ``spec.max_staleness`` versions."""
    engine, cold, fetch = generation_engine(spec.engine, weights)
    need = weights.version if target_version is None else target_version
    require_version(engine.version, need, f"worker {worker_name()}", spec.max_staleness)
    params = seeded(spec, seed)
    if spec.episodes is not None or spec.agent is not None:
        return _episodes(engine, shard, spec, params, cold, fetch)
    table, stats = engine.generate(shard, spec.n_samples, params, worker=worker_name(),
                                   share_prefixes=spec.share_prefixes)
    engine.sleep()  # colocated engines free the device for the trainer
    return _generated(table, stats, cold, fetch)


def _generated(table: pa.Table, stats: GenerationStats, cold: float,
               fetch: float) -> Generated:
    """``table`` beside ``stats``, with the cold start paid and the generation seconds (the
    engine's own where it reports them: an emulated one's include its weight load)."""
    stats.cold_start_s, stats.weight_fetch_s = cold, fetch
    stats.gen_seconds = stats.gen_seconds or stats.prefill_seconds + stats.decode_seconds
    return Generated(table, stats)


def _episodes(engine: GenerationBackend, shard: pa.Table, spec: GenSpec,
              params: SamplingParams, cold: float, fetch: float) -> Generated:
    """Multi-turn rollouts of a shard against an environment (``ops/rollouts/episode.py``)
    or an agent (``ops/rollouts/agent.py``); generation seconds and the environment's or
    agent's seconds are reported apart (``gen_seconds``, ``env_seconds``)."""
    stats = GenerationStats()
    play = run_episodes if spec.agent is None else run_agent_episodes
    table, episodes = play(engine, shard, spec.n_samples, params,
                           spec.episodes if spec.agent is None else spec.agent,
                           worker=worker_name(), stats=stats)
    stats.episodes = episodes
    return _generated(table, stats, cold, fetch)


# ---- chunked generation (elastic policy): cut at tau, then resume here or migrate ----

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
    Dask event ``pause_event`` is set; the rest stay paused on this worker under ``key``
    (with their KV cache where the engine keeps one) until ``resume_task`` or ``drop_task``.
    Returns ``{"done": rollouts, "cut": unfinished rows}``."""
    engine, cold, fetch = generation_engine(spec.engine, weights)
    require_version(engine.version, weights.version, f"worker {worker_name()}")
    params = seeded(spec, seed)
    if spec.episodes is not None or spec.agent is not None:  # episodes run whole: no tail
        return {"done": _episodes(engine, shard, spec, params, cold, fetch),
                "cut": shard.slice(0, 0)}
    stop = StopRule(until_finished, None if pause_event is None else PauseFlag(pause_event))
    chunk = engine.generate_until(shard, spec.n_samples, params, stop, worker=worker_name(),
                                  share_prefixes=spec.share_prefixes)
    engine.sleep()
    if chunk.paused is not None:
        PAUSED[key] = chunk.paused
    return {"done": _generated(chunk.done, chunk.stats, cold, fetch), "cut": chunk.cut}


def resume_task(key: str, weights: WeightsRef, spec: GenSpec) -> Generated:
    """Finish the paused chunk ``key`` here (the *stay* side: with its KV cache where the
    engine keeps one; its draws keyed as the chunk's were)."""
    paused = PAUSED.pop(key)
    engine, _, fetch = generation_engine(spec.engine, weights)
    require_version(engine.version, weights.version, f"worker {worker_name()}")
    table, stats = engine.resume(paused, spec.sampling, worker=worker_name())
    engine.sleep()
    return _generated(table, stats, 0.0, fetch)


def drop_task(key: str) -> bool:
    """Forget the paused chunk ``key`` (its tail was migrated elsewhere)."""
    return PAUSED.pop(key, None) is not None


def continue_task(cut: pa.Table, weights: WeightsRef, spec: GenSpec, seed: int) -> Generated:
    """Continue sequences cut on another worker, recomputing their prefix (the *move*
    side of cut-and-migrate)."""
    engine, cold, fetch = generation_engine(spec.engine, weights)
    require_version(engine.version, weights.version, f"worker {worker_name()}")
    table, stats = engine.continue_rows(cut, seeded(spec, seed), worker=worker_name())
    engine.sleep()
    return _generated(table, stats, cold, fetch)
