"""The graph's tasks, and the worker-local state (engines) they reach.

Engines are worker-local state reached from ordinary graph tasks, not Dask Actors: graph
tasks keep Dask's retries, resources, priorities and the rendered graph, while the module
globals below keep each worker process's model warm across tasks and iterations. The first
task on a worker loads the model (the *cold start*, measured and returned with the rollouts);
later tasks only fetch newer weights. Each worker pins torch to its share of the cores.

* generation workers (resource ``GEN``) hold ``_ENGINE``: policy + tokenizer + version;
* the trainer (resource ``TRAIN``) holds ``_TRAINER``: policy, optimizer, frozen reference.
"""

from __future__ import annotations

import copy
import importlib
import time
from dataclasses import dataclass, field

import pyarrow as pa
import torch
from distributed import get_worker
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from rlhfless.ops.advantage import compute_advantages
from rlhfless.ops.generate import SamplingParams, generate_rollouts
from rlhfless.ops.publish import WeightsRef, load_weights, publish_weights, require_version
from rlhfless.ops.reward import VERIFIERS, score
from rlhfless.ops.update import UpdateParams, update_policy


@dataclass(frozen=True)
class EngineSpec:
    model_path: str
    device: str = "auto"
    threads: int = 1


@dataclass(frozen=True)
class GenSpec:
    engine: EngineSpec
    n_samples: int
    sampling: SamplingParams
    share_prefixes: bool = True


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


@dataclass
class Engine:
    model: torch.nn.Module
    tokenizer: object
    version: int
    load_seconds: float


_ENGINE: dict[str, Engine] = {}
_TRAINER: dict[str, object] = {}


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_engine(spec: EngineSpec) -> Engine:
    """Model (bf16 on CUDA, fp32 on CPU) and tokenizer from a Hugging Face directory."""
    started = time.perf_counter()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(spec.threads)
    device = _device(spec.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
    return Engine(model, tokenizer, 0, time.perf_counter() - started)


def _worker_name() -> str:
    try:
        return str(get_worker().name)
    except ValueError:  # called outside a worker (tests, the sync scheduler)
        return "local"


def _generation_engine(spec: EngineSpec, weights: WeightsRef) -> tuple[Engine, float]:
    """This worker's engine at ``weights.version``, and the cold-start seconds paid now."""
    cold = 0.0
    engine = _ENGINE.get(spec.model_path)
    if engine is None:
        engine = _ENGINE[spec.model_path] = load_engine(spec)
        cold = engine.load_seconds
    if engine.version != weights.version:
        load_weights(engine.model, weights)
        engine.version = weights.version
    return engine, cold


def generate_task(shard: pa.Table, weights: WeightsRef, spec: GenSpec, seed: int) -> pa.Table:
    """Rollouts of one shard; run statistics travel in the table's schema metadata."""
    engine, cold = _generation_engine(spec.engine, weights)
    require_version(engine.version, weights.version, f"worker {_worker_name()}")
    params = SamplingParams(**{**spec.sampling.__dict__, "seed": seed})
    table, stats = generate_rollouts(
        engine.model, engine.tokenizer, shard, spec.n_samples, params,
        policy_version=engine.version, worker=_worker_name(), share_prefixes=spec.share_prefixes,
    )
    meta = {"prefill_tokens": stats.prefill_tokens, "decode_tokens": stats.decode_tokens,
            "decode_steps": stats.decode_steps, "gen_seconds": stats.seconds,
            "cold_start_s": cold}
    return table.replace_schema_metadata({k: str(v) for k, v in meta.items()})


def resolve_reward(name: str):
    """A built-in verifier by name, or a user function given as ``"module:function"``."""
    if name in VERIFIERS:
        return VERIFIERS[name]
    module, _, attr = name.partition(":")
    if not attr:
        raise ValueError(f"reward {name!r}: not a verifier {sorted(VERIFIERS)} or 'module:fn'")
    return getattr(importlib.import_module(module), attr)


def reward_task(rollouts: pa.Table, spec: RewardSpec) -> pa.Table:
    fns = {source: resolve_reward(name) for source, name in spec.rewards.items()}
    scored = score(rollouts, fns, default=spec.default, timeout_s=spec.timeout_s,
                   fallback=spec.fallback)
    return scored.replace_schema_metadata(rollouts.schema.metadata)


def advantage_task(scored: pa.Table, algorithm: str, n_samples: int) -> pa.Table:
    if len(scored) == 0:
        return scored.append_column("advantage", pa.array([], pa.float32()))
    trainable = compute_advantages(scored, algorithm, n_samples=n_samples)
    return trainable.replace_schema_metadata(scored.schema.metadata)


def _trainer(spec: TrainSpec) -> dict:
    state = _TRAINER.get(spec.engine.model_path)
    if state is None:
        engine = load_engine(spec.engine)
        params = spec.update
        state = {
            "engine": engine,
            "optimizer": torch.optim.AdamW(engine.model.parameters(), lr=params.lr,
                                           weight_decay=0.0),
            "ref": copy.deepcopy(engine.model).eval() if params.kl_coef > 0 else None,
            "cold_start_s": engine.load_seconds,
        }
        _TRAINER[spec.engine.model_path] = state
    return state


def update_task(trainables: list[pa.Table], weights: WeightsRef, spec: TrainSpec) -> dict:
    """One policy update on the concatenated shards; returns the metrics."""
    state = _trainer(spec)
    engine: Engine = state["engine"]
    require_version(engine.version, weights.version, "trainer")
    batch = pa.concat_tables([t.replace_schema_metadata(None) for t in trainables])
    started = time.perf_counter()
    metrics = update_policy(engine.model, state["optimizer"], batch, spec.update,
                            engine.tokenizer.pad_token_id, ref_model=state["ref"])
    metrics["update_seconds"] = time.perf_counter() - started
    metrics["trainer_cold_start_s"] = state.pop("cold_start_s", 0.0)
    return metrics


def publish_task(metrics: dict, spec: TrainSpec, version: int) -> WeightsRef:
    """Publish the trainer's weights as ``version`` (after ``metrics``' update ran)."""
    engine: Engine = _trainer(spec)["engine"]
    ref = publish_weights(engine.model, spec.store, version, keep=spec.keep_versions)
    engine.version = version
    return ref
