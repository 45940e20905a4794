"""Trainer tasks, on the training pool (resource ``TRAIN``): update, publish, checkpoint.

The trainer process holds a ``Trainer`` per model path: policy, optimizer, frozen reference,
and the token the driver tagged it with; it writes and reads its own part of a checkpoint
(``save_trainer_task``, ``restore_trainer_task``; why: ``checkpoint.py``). With
``train_workers > 1`` every TRAIN worker is a rank holding its shard of the policy
(``ranks.py``); ``update_task`` and ``publish_task`` run on one of them and fan out to all.
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
from torch.distributed.tensor import DTensor

from rlhfless.ops.algo.offpolicy import check_staleness
from rlhfless.ops.algo.parallel import Ranks, full_state, wrap_model
from rlhfless.ops.algo.update import UpdateParams, update_policy
from rlhfless.ops.engine.backend import load_causal_lm
from rlhfless.ops.engine.engine_types import EngineSpec, WeightsRef, require_version
from rlhfless.ops.engine.forward import enable_checkpointing
from rlhfless.ops.engine.gen_stats import Generated
from rlhfless.ops.engine.lora import lora_config, trainable_names
from rlhfless.ops.engine.publish import publish_state, publish_weights

from ..durable.checkpoint import read_trainer, write_trainer
from .engines import worker_name
from .ranks import leave_group, on_ranks, this_rank


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
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    version: int
    load_seconds: float


@dataclass
class Trainer:
    """This process's trainer, kept between tasks (one per model path)."""

    loaded: LoadedModel  # its ``model`` unwrapped; ``version`` is the trainer's policy version
    model: torch.nn.Module  # sharded or replicated over the ranks when world > 1, else engine's
    optimizer: torch.optim.Optimizer
    ref: torch.nn.Module | None  # the frozen reference (kl_coef > 0), else None
    cold_start_s: float  # the load's seconds, reported by the first update (then 0)
    token: str | None = None  # the driver's name for this trainer's life; None until started


_TRAINER: dict[str, Trainer] = {}  # model path -> this process's trainer


def load_model(spec: EngineSpec) -> LoadedModel:
    """Model (bf16 on CUDA, fp32 on CPU) and tokenizer from a Hugging Face directory."""
    started = time.perf_counter()
    model, tokenizer = load_causal_lm(spec.model_path, spec.device, spec.threads, spec.lora)
    return LoadedModel(model, tokenizer, 0, time.perf_counter() - started)


def _ranks(spec: TrainSpec) -> Ranks | None:
    return this_rank() if spec.world > 1 else None


def _trainer(spec: TrainSpec) -> Trainer:
    """This process's trainer for ``spec``'s model, loaded on first use."""
    state = _TRAINER.get(spec.engine.model_path)
    if state is None:
        loaded = load_model(spec.engine)
        params = spec.update
        ref = copy.deepcopy(loaded.model).eval() if params.kl_coef > 0 else None
        if spec.gradient_checkpointing:
            enable_checkpointing(loaded.model)
        ranks = _ranks(spec)
        model = loaded.model if ranks is None else wrap_model(loaded.model, ranks)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                      lr=params.lr, weight_decay=0.0)
        state = Trainer(loaded, model, optimizer, ref, loaded.load_seconds)
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
    loaded = state.loaded
    require_version(loaded.version, weights.version, "trainer")
    batch = pa.concat_tables([t.table for t in trainables])
    check_staleness(batch, loaded.version, spec.max_staleness, "trainer")
    started = time.perf_counter()
    device = next(loaded.model.parameters()).device
    for group in state.optimizer.param_groups:  # the spec's: a rollback lowers it (guard.py)
        group["lr"] = spec.update.lr
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec.bf16):
        metrics = update_policy(state.model, state.optimizer, batch, spec.update,
                                loaded.tokenizer.pad_token_id, ref_model=state.ref,
                                ranks=_ranks(spec))
    metrics["update_seconds"] = time.perf_counter() - started
    metrics["lr"] = spec.update.lr
    metrics["trainer_cold_start_s"], state.cold_start_s = state.cold_start_s, 0.0
    return metrics


def publish_task(metrics: dict, spec: TrainSpec, version: int) -> WeightsRef:
    """Publish the trainer's weights as ``version`` (after ``metrics``' update ran). With
    ranks, every rank takes part in gathering the whole weights and rank 0 writes them."""
    return _each_rank(_publish_rank, spec, version)[0]


def _publish_rank(spec: TrainSpec, version: int) -> WeightsRef | None:
    state = _trainer(spec)
    loaded = state.loaded
    ranks = _ranks(spec)
    if ranks is None:
        ref = publish_weights(loaded.model, spec.store, version, keep=spec.keep_versions)
    else:
        whole = full_state(state.model, keep=ranks.rank == 0,
                           names=trainable_names(loaded.model))
        ref = (publish_state(whole, spec.store, version, keep=spec.keep_versions,
                             lora=lora_config(loaded.model)) if ranks.rank == 0 else None)
    loaded.version = version
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
    state.token = token
    return state.loaded.version


def trainer_token_task(spec: TrainSpec) -> str | None:
    """The token of this process's trainer: None after a restart (a new process)."""
    state = _TRAINER.get(spec.engine.model_path)
    return None if state is None else state.token


def save_trainer_task(spec: TrainSpec, path: str, token: str) -> dict:
    """Write weights, optimizer and RNG of the trainer tagged ``token`` under ``path``.
    A restarted trainer (another token) refuses: its state is not the run's."""
    state = _TRAINER.get(spec.engine.model_path)
    if state is None or state.token != token:
        raise RuntimeError(f"trainer on {worker_name()} is not the trainer {token} of this "
                           "run (it restarted); its state cannot be checkpointed")
    started = time.perf_counter()
    n = write_trainer(path, state.model, state.optimizer, _ranks(spec))
    return {"version": state.loaded.version, "bytes": n, "finite": _finite(state.model),
            "seconds": time.perf_counter() - started}


def _finite(model: torch.nn.Module) -> bool:
    """Whether every weight this rank holds (its shard, with ranks) is finite."""
    local = (p.to_local() if isinstance(p, DTensor) else p for p in model.parameters())
    return all(bool(torch.isfinite(t.detach()).all()) for t in local)


def restore_trainer_task(spec: TrainSpec, path: str, token: str) -> int:
    """Load the checkpoint at ``path`` into this process's trainer (loading the model first
    if needed; the frozen reference stays the initial model) and tag it with ``token``;
    returns the restored policy version."""
    state = _trainer(spec)
    loaded = state.loaded
    loaded.version = read_trainer(path, state.model, state.optimizer, _ranks(spec))
    state.token = token
    return loaded.version
