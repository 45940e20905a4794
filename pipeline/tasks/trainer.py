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
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch.distributed.tensor import DTensor

from rlhfless.ops.algo.offpolicy import check_staleness
from rlhfless.ops.algo.parallel import Ranks, full_state, wrap_model
from rlhfless.ops.algo.update import UpdateParams, update_policy
from rlhfless.ops.engine.backend import load_causal_lm
from rlhfless.ops.engine.engine_types import EngineSpec, RemoteStore, WeightsRef, require_version
from rlhfless.ops.engine.forward import enable_checkpointing
from rlhfless.ops.engine.gen_stats import Generated
from rlhfless.ops.engine.lora import lora_config, trainable_names, trainable_state

from ..durable.checkpoint import read_trainer, write_trainer
from .emulated import EmulatedTrainer
from .engines import worker_name
from .ranks import leave_group, on_ranks, this_rank
from .weight_store import publish_version


@dataclass(frozen=True)
class TrainSpec:
    engine: EngineSpec
    update: UpdateParams
    store: str | RemoteStore | None  # published weights' directory or URL; None: held
    keep_versions: int = 2
    max_staleness: int = 0  # oldest sample the update accepts, in versions behind the trainer
    world: int = 1  # trainer ranks (train_workers); > 1: one process group over the pool
    parallel: str = "fsdp"  # world > 1: "fsdp" (FSDP2 shards) | "ddp" (replicas)
    bf16: bool = False  # mixed precision: bf16 autocast in the update, fp32 weights and Adam
    gradient_checkpointing: bool = False  # recompute each layer in the backward pass
    emulate: Any = None  # ``emulated.EmulatedLearner``: the profile's learner, no tensors


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
    # one rank with frozen weights (LoRA): what trains, by name (the optimizer updates these
    # tensors in place), published without walking the model (state_dict: 25 ms at 0.5B)
    trainables: dict[str, torch.Tensor] | None = None

    @property
    def version(self) -> int:
        return self.loaded.version

    def update(self, trainables: list[Generated], spec: TrainSpec) -> dict:
        """One policy update on the concatenated shards (this rank's part, with ranks)."""
        loaded = self.loaded
        batch = pa.concat_tables([t.table for t in trainables])
        started = time.perf_counter()
        device = next(loaded.model.parameters()).device
        for group in self.optimizer.param_groups:  # the spec's: a rollback lowers it (guard.py)
            group["lr"] = spec.update.lr
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=spec.bf16):
            metrics = update_policy(self.model, self.optimizer, batch, spec.update,
                                    loaded.tokenizer.pad_token_id, ref_model=self.ref,
                                    ranks=_ranks(spec))
        metrics["update_seconds"] = time.perf_counter() - started
        metrics["lr"] = spec.update.lr
        metrics["trainer_cold_start_s"], self.cold_start_s = self.cold_start_s, 0.0
        return metrics

    def publish(self, spec: TrainSpec, version: int) -> WeightsRef | None:
        """The weights published as ``version``; with ranks, every rank takes part in
        gathering them and rank 0 writes them (the others return None)."""
        loaded = self.loaded
        ranks = _ranks(spec)
        model = loaded.model
        if self.trainables is not None:
            whole = self.trainables
        elif ranks is None:
            whole = trainable_state(model, model.state_dict())
        else:
            whole = full_state(self.model, keep=ranks.rank == 0, names=trainable_names(model))
        ref = (publish_version(whole, spec.store, version, spec.keep_versions,
                               lora_config(model)) if ranks is None or ranks.rank == 0 else None)
        loaded.version = version
        return ref

    def save(self, path: str, spec: TrainSpec) -> dict:
        """Weights, optimizer and RNG under ``path`` (this rank's shard, with ranks)."""
        started = time.perf_counter()
        n = write_trainer(path, self.model, self.optimizer, _ranks(spec))
        return {"version": self.version, "bytes": n, "finite": _finite(self.model),
                "seconds": time.perf_counter() - started}

    def restore(self, path: str, spec: TrainSpec) -> int:
        """Back to the checkpoint at ``path`` (the frozen reference stays the initial model)."""
        self.loaded.version = read_trainer(path, self.model, self.optimizer, _ranks(spec))
        return self.loaded.version


_TRAINER: dict[str, Trainer | EmulatedTrainer] = {}  # model path -> this process's trainer


def load_model(spec: EngineSpec) -> LoadedModel:
    """Model (bf16 on CUDA, fp32 on CPU) and tokenizer from a Hugging Face directory."""
    started = time.perf_counter()
    model, tokenizer = load_causal_lm(spec.model_path, spec.device, spec.threads, spec.lora)
    return LoadedModel(model, tokenizer, 0, time.perf_counter() - started)


def _ranks(spec: TrainSpec) -> Ranks | None:
    return this_rank() if spec.world > 1 else None


def _trainer(spec: TrainSpec) -> Trainer | EmulatedTrainer:
    """This process's trainer for ``spec``'s model, loaded on first use (the profile's
    learner where ``spec.emulate`` says)."""
    state = _TRAINER.get(spec.engine.model_path)
    if state is None and spec.emulate is not None:
        state = _TRAINER[spec.engine.model_path] = EmulatedTrainer(spec.emulate)
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
        names = trainable_names(model) if ranks is None else None
        trainables = None if names is None else {
            n: p.detach() for n, p in model.named_parameters() if n in names}
        state = Trainer(loaded, model, optimizer, ref, loaded.load_seconds,
                        trainables=trainables)
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
    require_version(state.version, weights.version, "trainer")
    check_staleness(pa.concat_tables([t.table for t in trainables]), state.version,
                    spec.max_staleness, "trainer")
    return state.update(trainables, spec)


def publish_task(metrics: dict, spec: TrainSpec, version: int) -> WeightsRef:
    """Publish the trainer's weights as ``version`` (after ``metrics``' update ran). With
    ranks, every rank takes part in gathering the whole weights and rank 0 writes them."""
    return _each_rank(_publish_rank, spec, version)[0]


def _publish_rank(spec: TrainSpec, version: int) -> WeightsRef | None:
    return _trainer(spec).publish(spec, version)


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
    return state.version


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
    return state.save(path, spec)


def _finite(model: torch.nn.Module) -> bool:
    """Whether every weight this rank holds (its shard, with ranks) is finite."""
    local = (p.to_local() if isinstance(p, DTensor) else p for p in model.parameters())
    return all(bool(torch.isfinite(t.detach()).all()) for t in local)


def restore_trainer_task(spec: TrainSpec, path: str, token: str) -> int:
    """Load the checkpoint at ``path`` into this process's trainer (loading the model first
    if needed; the frozen reference stays the initial model) and tag it with ``token``;
    returns the restored policy version."""
    state = _trainer(spec)
    version = state.restore(path, spec)
    state.token = token
    return version
