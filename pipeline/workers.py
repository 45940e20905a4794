"""The graph's tasks, and the worker-local state (engines) they reach.

Engines are worker-local state reached from ordinary graph tasks, not Dask Actors: graph
tasks keep Dask's retries, resources, priorities and the rendered graph, while the module
globals below keep each worker process's model warm across tasks and iterations. The first
task on a worker loads the model (the *cold start*, measured and returned with the rollouts);
later tasks only fetch newer weights. Each worker pins torch to its share of the cores.

* generation workers (resource ``GEN``) hold ``_ENGINE``: a generation backend (hf or
  vllm, ``ops/backend.py``) holding the policy at some version;
* the trainer (resource ``TRAIN``) holds ``_TRAINER``: policy, optimizer, frozen reference,
  and the token the driver tagged it with; it writes and reads its own part of a checkpoint
  (``save_trainer_task``, ``restore_trainer_task``; why: ``checkpoint.py``). With
  ``train_workers > 1`` every TRAIN worker is a rank holding its shard of the policy
  (``ranks.py``); ``update_task`` and ``publish_task`` run on one of them and fan out to all.
"""

from __future__ import annotations

import copy
import importlib
import random
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import torch
from distributed import get_worker

from rlhfless.ops.advantage import compute_advantages
from rlhfless.ops.backend import GenerationBackend, HFBackend, make_backend
from rlhfless.ops.episode import EpisodeParams, run_episodes, score_episodes
from rlhfless.ops.forward import enable_checkpointing
from rlhfless.ops.gen_stats import Generated, GenerationStats
from rlhfless.ops.generate import (
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
from rlhfless.ops.lora import LoraSpec, trainable_names
from rlhfless.ops.offpolicy import check_staleness
from rlhfless.ops.parallel import Ranks, full_state, wrap_model
from rlhfless.ops.publish import WeightsRef, publish_state, publish_weights, require_version
from rlhfless.ops.reward import VERIFIERS, score
from rlhfless.ops.schema import TRAINABLE
from rlhfless.ops.update import UpdateParams, update_policy

from .checkpoint import read_trainer, write_trainer
from .ranks import leave_group, on_ranks, this_rank


@dataclass(frozen=True)
class EngineSpec:
    model_path: str
    device: str = "auto"
    threads: int = 1
    backend: str = "hf"  # generation backend (ops/backend.py): "hf" | "vllm"
    colocate: bool = False  # the generation engine sleeps between rollouts (vllm)
    lora: LoraSpec | None = None  # LoRA adapters on the model; only they train and move


@dataclass(frozen=True)
class GenSpec:
    engine: EngineSpec
    n_samples: int
    sampling: SamplingParams
    share_prefixes: bool = True
    max_staleness: int = 0  # async: versions the engine may lag the consuming trainer
    episodes: EpisodeParams | None = None  # multi-turn rollouts against an environment


@dataclass(frozen=True)
class RewardSpec:
    rewards: dict[str, str] = field(default_factory=dict)  # data_source -> verifier/"mod:fn"
    default: str = "math"
    timeout_s: float = 5.0
    fallback: float = 0.0


@dataclass(frozen=True)
class TrainSpec:
    engine: EngineSpec
    update: UpdateParams
    store: str  # directory of published weights
    keep_versions: int = 2
    max_staleness: int = 0  # oldest sample the update accepts, in versions behind the trainer
    world: int = 1  # trainer ranks (train_workers); > 1: one process group over the pool
    parallel: str = "fsdp"  # world > 1: "fsdp" (FSDP2 shards) | "ddp" (replicas)
    bf16: bool = False  # mixed precision: bf16 autocast in the update, fp32 weights and Adam
    gradient_checkpointing: bool = False  # recompute each layer in the backward pass


@dataclass
class Engine:
    model: torch.nn.Module
    tokenizer: object
    version: int
    load_seconds: float


_ENGINE: dict[str, GenerationBackend] = {}
_TRAINER: dict[str, object] = {}
_PAUSED: dict[str, tuple[Decoding, pa.Table, float]] = {}  # chunk key -> paused decoding


def load_engine(spec: EngineSpec) -> Engine:
    """Model (bf16 on CUDA, fp32 on CPU) and tokenizer from a Hugging Face directory."""
    hf = HFBackend(spec.model_path, spec.device, spec.threads, spec.lora)
    hf.load()
    return Engine(hf.model, hf.tokenizer, 0, hf.load_seconds)


def _worker_name() -> str:
    try:
        return str(get_worker().name)
    except ValueError:  # called outside a worker (tests, the sync scheduler)
        return "local"


def _generation_engine(spec: EngineSpec,
                       weights: WeightsRef) -> tuple[GenerationBackend, float]:
    """This worker's engine (awake) at ``weights.version``, and the cold-start seconds paid
    now. The call order is the backend protocol's (ops/backend.py)."""
    cold = 0.0
    engine = _ENGINE.get(spec.model_path)
    if engine is None:
        engine = make_backend(spec.backend, spec.model_path, spec.device, spec.threads,
                              colocate=spec.colocate, lora=spec.lora)
        engine.load()
        _ENGINE[spec.model_path] = engine
        cold = engine.load_seconds
    engine.wake()
    if engine.version != weights.version:
        engine.set_weights(weights)
    return engine, cold


def _hf_engine(spec: EngineSpec, weights: WeightsRef) -> tuple[HFBackend, float]:
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
    require_version(engine.version, need, f"worker {_worker_name()}", spec.max_staleness)
    params = SamplingParams(**{**spec.sampling.__dict__, "seed": seed})
    if spec.episodes is not None:
        return _episodes(engine, shard, spec, params, cold)
    table, stats = engine.generate(shard, spec.n_samples, params, worker=_worker_name(),
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
    """Multi-turn rollouts of a shard (``ops/episode.py``); generation seconds and
    environment seconds are reported apart (``gen_seconds``, ``env_seconds``)."""
    if not isinstance(engine, HFBackend):
        raise TypeError("multi-turn rollouts need backend 'hf'")
    stats = GenerationStats()
    table, episodes = run_episodes(engine.model, engine.tokenizer, shard, spec.n_samples,
                                   params, spec.episodes, policy_version=engine.version,
                                   worker=_worker_name(), stats=stats)
    stats.episodes = episodes
    return _generated(table, stats, cold)


# ---- chunked generation (elastic policy): cut at tau, then resume here or migrate ----

def _finished_and_cut(dec: Decoding, rows: pa.Table, engine: Engine, start: float,
                      stats: GenerationStats, cold: float) -> dict:
    """Rollouts of the sequences that left the batch, and the cut (unfinished) ones with
    their tokens so far (``partial_ids``, ``partial_logprobs``) for a continuation."""
    unfinished = dec.live.tolist()
    pending = set(unfinished)
    done = [i for i in range(len(rows)) if i not in pending]
    results = dec.results()
    table = rollouts_table(rows.take(pa.array(done, pa.int64())), [results[i] for i in done],
                           engine.tokenizer, policy_version=engine.version,
                           worker=_worker_name(), start=start, end=time.time())
    cut = rows.take(pa.array(unfinished, pa.int64()))
    cut = cut.append_column("partial_ids", pa.array([results[i][0] for i in unfinished],
                                                    pa.list_(pa.int32())))
    cut = cut.append_column("partial_logprobs", pa.array([results[i][1] for i in unfinished],
                                                         pa.list_(pa.float32())))
    return {"done": _generated(table, stats, cold), "cut": cut}


def generate_chunk_task(shard: pa.Table, weights: WeightsRef, spec: GenSpec, seed: int,
                        until_finished: float, key: str) -> dict:
    """Generate a shard until ``until_finished`` of its sequences are done; the rest stay
    paused on this worker under ``key`` (KV cache and all) until ``resume_task`` or
    ``drop_task``. Returns ``{"done": rollouts, "cut": unfinished rows}``."""
    engine, cold = _hf_engine(spec.engine, weights)
    require_version(engine.version, weights.version, f"worker {_worker_name()}")
    params = SamplingParams(**{**spec.sampling.__dict__, "seed": seed})
    if spec.episodes is not None:  # episodes run whole: there is no tail to cut
        return {"done": _episodes(engine, shard, spec, params, cold), "cut": shard.slice(0, 0)}
    stats, start = GenerationStats(), time.time()
    rows = expand_samples(shard, spec.n_samples)
    tok = engine.tokenizer
    dec = prefill_prompts(engine.model, shard.column("prompt_ids").to_pylist(), spec.n_samples,
                          params, tok.pad_token_id, prefix_lens_of(shard, spec.share_prefixes),
                          stats, row_keys(seed, rows))
    run_decoding(engine.model, dec, params, tok.eos_token_id, stats, until_finished)
    out = _finished_and_cut(dec, rows, engine, start, stats, cold)
    if len(dec.live):
        _PAUSED[key] = (dec, rows, start)
    return out


def resume_task(key: str, weights: WeightsRef, spec: GenSpec) -> Generated:
    """Finish the paused decoding ``key`` here, with its KV cache (the *stay* side)."""
    dec, rows, start = _PAUSED.pop(key)
    engine, _ = _hf_engine(spec.engine, weights)
    require_version(engine.version, weights.version, f"worker {_worker_name()}")
    tail = dec.live.tolist()
    stats = GenerationStats()
    run_decoding(engine.model, dec, spec.sampling, engine.tokenizer.eos_token_id, stats)
    results = dec.results()
    table = rollouts_table(rows.take(pa.array(tail, pa.int64())), [results[i] for i in tail],
                           engine.tokenizer, policy_version=engine.version,
                           worker=_worker_name(), start=start, end=time.time())
    return _generated(table, stats, 0.0)


def drop_task(key: str) -> bool:
    """Forget the paused decoding ``key`` (its tail was migrated elsewhere)."""
    return _PAUSED.pop(key, None) is not None


def continue_task(cut: pa.Table, weights: WeightsRef, spec: GenSpec, seed: int) -> Generated:
    """Continue sequences cut on another worker, recomputing their prefix (the *move*
    side of cut-and-migrate)."""
    engine, cold = _hf_engine(spec.engine, weights)
    require_version(engine.version, weights.version, f"worker {_worker_name()}")
    params = SamplingParams(**{**spec.sampling.__dict__, "seed": seed})
    stats, start = GenerationStats(), time.time()
    tok = engine.tokenizer
    dec = prefill_continuations(engine.model, cut, params, tok.pad_token_id, stats)
    run_decoding(engine.model, dec, params, tok.eos_token_id, stats)
    rows = cut.drop_columns(["partial_ids", "partial_logprobs"])
    table = rollouts_table(rows, dec.results(), tok, policy_version=engine.version,
                           worker=_worker_name(), start=start, end=time.time())
    return _generated(table, stats, cold)


def resolve_reward(name: str):
    """A built-in verifier by name, or a user function given as ``"module:function"``."""
    if name in VERIFIERS:
        return VERIFIERS[name]
    module, _, attr = name.partition(":")
    if not attr:
        raise ValueError(f"reward {name!r}: not a verifier {sorted(VERIFIERS)} or 'module:fn'")
    return getattr(importlib.import_module(module), attr)


def reward_task(rollouts: Generated, spec: RewardSpec) -> Generated:
    """The rollouts scored (``reward``, ``reward_error``), beside the same statistics."""
    table = rollouts.table
    if "env_reward" in table.column_names:  # episodes: their environment scored them
        return rollouts.with_table(score_episodes(table))
    fns = {source: resolve_reward(name) for source, name in spec.rewards.items()}
    return rollouts.with_table(score(table, fns, default=spec.default, timeout_s=spec.timeout_s,
                                     fallback=spec.fallback))


def advantage_task(scored: Generated, algorithm: str, n_samples: int) -> Generated:
    """The scored rows with their ``advantage``, beside the same statistics."""
    table = scored.table
    if len(table) == 0:
        return scored.with_table(table.append_column(TRAINABLE.field("advantage"),
                                                     pa.array([], pa.float32())))
    return scored.with_table(compute_advantages(table, algorithm, n_samples=n_samples))


def _ranks(spec: TrainSpec) -> Ranks | None:
    return this_rank() if spec.world > 1 else None


def _trainer(spec: TrainSpec) -> dict:
    """This process's trainer: ``engine`` (its ``model`` unwrapped), ``model`` (sharded or
    replicated over the ranks when ``spec.world > 1``, else the engine's), ``optimizer``."""
    state = _TRAINER.get(spec.engine.model_path)
    if state is None:
        engine = load_engine(spec.engine)
        params = spec.update
        ref = copy.deepcopy(engine.model).eval() if params.kl_coef > 0 else None
        if spec.gradient_checkpointing:
            enable_checkpointing(engine.model)
        ranks = _ranks(spec)
        model = engine.model if ranks is None else wrap_model(engine.model, ranks)
        state = {
            "engine": engine,
            "model": model,
            "optimizer": torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                           lr=params.lr, weight_decay=0.0),
            "ref": ref,
            "cold_start_s": engine.load_seconds,
        }
        _TRAINER[spec.engine.model_path] = state
    return state


def drop_trainer() -> None:
    """Forget this process's trainer (its process group is about to go)."""
    _TRAINER.clear()


def leave_trainer_task() -> bool:
    """Drop the trainer and leave the process group (``ranks.form_group``'s first step)."""
    drop_trainer()
    return leave_group()


def _each_rank(fn, *args) -> list:
    """``fn(*args)`` on this rank and, with ranks, on every other one; results by rank."""
    spec = next(a for a in args if isinstance(a, TrainSpec))
    return on_ranks(fn, *args) if spec.world > 1 else [fn(*args)]


def update_task(trainables: list[Generated], weights: WeightsRef, spec: TrainSpec) -> dict:
    """One policy update on the concatenated shards; returns the metrics. Every row must
    come from a version at most ``spec.max_staleness`` behind the trainer's."""
    return _each_rank(_update_rank, trainables, weights, spec)[0]


def _update_rank(trainables: list[Generated], weights: WeightsRef, spec: TrainSpec) -> dict:
    state = _trainer(spec)
    engine: Engine = state["engine"]
    require_version(engine.version, weights.version, "trainer")
    batch = pa.concat_tables([t.table for t in trainables])
    check_staleness(batch, engine.version, spec.max_staleness, "trainer")
    started = time.perf_counter()
    device = next(engine.model.parameters()).device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec.bf16):
        metrics = update_policy(state["model"], state["optimizer"], batch, spec.update,
                                engine.tokenizer.pad_token_id, ref_model=state["ref"],
                                ranks=_ranks(spec))
    metrics["update_seconds"] = time.perf_counter() - started
    metrics["trainer_cold_start_s"] = state.pop("cold_start_s", 0.0)
    return metrics


def publish_task(metrics: dict, spec: TrainSpec, version: int) -> WeightsRef:
    """Publish the trainer's weights as ``version`` (after ``metrics``' update ran). With
    ranks, every rank takes part in gathering the whole weights and rank 0 writes them."""
    return _each_rank(_publish_rank, spec, version)[0]


def _publish_rank(spec: TrainSpec, version: int) -> WeightsRef | None:
    state = _trainer(spec)
    engine: Engine = state["engine"]
    ranks = _ranks(spec)
    if ranks is None:
        ref = publish_weights(engine.model, spec.store, version, keep=spec.keep_versions)
    else:
        whole = full_state(state["model"], keep=ranks.rank == 0,
                           names=trainable_names(engine.model))
        ref = (publish_state(whole, spec.store, version, keep=spec.keep_versions)
               if ranks.rank == 0 else None)
    engine.version = version
    return ref


# ---- checkpoints: the trainer writes and reads its own state (see checkpoint.py) ---------

def _seed_process(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def start_trainer_task(spec: TrainSpec, seed: int, token: str) -> int:
    """Load the trainer if this process has none, seed its RNGs and tag it with ``token``
    (the driver's name for this trainer's life); returns its policy version. With ranks the
    driver runs this and the three tasks below on every rank."""
    state = _trainer(spec)
    _seed_process(seed)
    state["token"] = token
    return state["engine"].version


def trainer_token_task(spec: TrainSpec) -> str | None:
    """The token of this process's trainer: None after a restart (a new process)."""
    state = _TRAINER.get(spec.engine.model_path)
    return None if state is None else state.get("token")


def save_trainer_task(spec: TrainSpec, path: str, token: str) -> dict:
    """Write weights, optimizer and RNG of the trainer tagged ``token`` under ``path``.
    A restarted trainer (another token) refuses: its state is not the run's."""
    state = _TRAINER.get(spec.engine.model_path)
    if state is None or state.get("token") != token:
        raise RuntimeError(f"trainer on {_worker_name()} is not the trainer {token} of this "
                           "run (it restarted); its state cannot be checkpointed")
    started = time.perf_counter()
    n = write_trainer(path, state["model"], state["optimizer"], _ranks(spec))
    return {"version": state["engine"].version, "bytes": n,
            "seconds": time.perf_counter() - started}


def restore_trainer_task(spec: TrainSpec, path: str, token: str) -> int:
    """Load the checkpoint at ``path`` into this process's trainer (loading the model first
    if needed; the frozen reference stays the initial model) and tag it with ``token``;
    returns the restored policy version."""
    state = _trainer(spec)
    engine: Engine = state["engine"]
    engine.version = read_trainer(path, state["model"], state["optimizer"], _ranks(spec))
    state["token"] = token
    return engine.version
