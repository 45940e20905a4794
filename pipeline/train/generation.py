"""How the mode runner has a batch generated: one seam, two sides behind it.

The runner (``modes.py``) asks a ``Generation`` for a batch's trainable rows and does not
know which policy runs behind it:

* ``GraphGeneration`` (``policy = "static"``): the batch travels in one graph (dedup, shards,
  generate, reward, advantage: ``graph.trainable_graph``) computed on the fixed pool, so a
  worker's death loses nothing; a batch generated ahead (async modes) is cut into shards on
  the trainer, which the update submitted next would hold, so it is cut before
  (``shards_ahead_first``);
* ``ElasticGeneration`` (``elastic.py``, ``policy = "elastic"``): the controller that sizes
  the pool, places shards by predicted length and handles the tails, blocking while it runs
  (so it overlaps the update submitted before it).

Both return a ``Generating``; ``after_update`` hands back what the scaling policy should learn
of the iteration (None when nothing but the lengths); ``log`` writes ``decisions.jsonl``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from distributed import wait

from rlhfless.ops.engine.engine_types import WeightsRef
from rlhfless.ops.engine.gen_stats import GenerationStats
from rlhfless.schedulers.dask.plugin import drain_target_changes
from rlhfless.schedulers.scaling_policy import IterationTimings, ScalingPolicy

from ..cluster.pools import PoolCluster
from ..config import Config
from ..durable.runs import RunDir
from ..task_keys import iteration_of
from .graph import trainable_graph


@dataclass
class Generating:
    """A batch under way: the dedup plan, one trainable table per shard (futures), facts
    for the metrics, and the futures of its shards where the trainer cuts them."""

    plan: Any
    trainables: list
    facts: dict = field(default_factory=dict)
    shards: list = field(default_factory=list)


class Generation(ABC):
    """What both sides share: the cluster, the config, the policy and the decisions log."""

    #: whether batches ahead are started before the update is submitted (see above)
    shards_ahead_first = False

    def __init__(self, pc: PoolCluster, cfg: Config, run: RunDir,
                 scaling: ScalingPolicy) -> None:
        self.pc, self.cfg, self.run, self.scaling = pc, cfg, run, scaling
        self.iteration = 0  # the last generated

    def log(self, iteration: int, **record) -> dict:
        record = {"t": time.time(), "iteration": iteration} | record
        self.run.append_jsonl("decisions.jsonl", record)
        return record

    def log_queue_targets(self, iteration: int) -> None:
        """Write the target changes the queued work made in the scheduler (each under the
        iteration of the task that made it)."""
        for change in self.pc.client.run_on_scheduler(drain_target_changes):
            self.log(iteration_of(change.pop("key")) or iteration, **change)

    @abstractmethod
    def generate(self, batch: pa.Table, weights: WeightsRef, iteration: int, target: int,
                 specs, seed: int) -> Generating:
        """Batch ``iteration``'s trainable rows from ``weights``, for trainer ``v{target}``."""

    def after_update(self, update_seconds: float,
                     shards: list[GenerationStats]) -> IterationTimings | None:
        """What the iteration measured for the policy, beyond its rows' lengths."""
        self.log_queue_targets(self.iteration)
        return None


class GraphGeneration(Generation):
    """The static pool's side: one graph per batch (see the module docstring)."""

    shards_ahead_first = True

    def generate(self, batch: pa.Table, weights: WeightsRef, iteration: int, target: int,
                 specs, seed: int) -> Generating:
        self.iteration = iteration
        plan, parts, tables = trainable_graph(
            batch, weights, iteration, self.cfg.gen_workers, specs.gen, specs.reward,
            algorithm=self.cfg.algorithm, seed=seed, min_prefix=self.cfg.min_prefix,
            target_version=target, scaling=self.scaling, turn_credit=self.cfg.turn_credit)
        plan, *futures = self.pc.client.compute([plan, *parts, *tables], optimize_graph=False)
        shards, trainables = futures[: len(parts)], futures[len(parts):]
        if target > weights.version:  # ahead: its shards are made on the trainer,
            wait(shards)  # which the update submitted next would hold
        return Generating(plan, trainables, shards=shards)
