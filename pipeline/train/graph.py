"""One RL iteration as a Dask task graph.

    dedup ─ shard ─┬─ generate[0] ─ reward[0] ─ advantage[0] ─┐
                   ├─ generate[1] ─ reward[1] ─ advantage[1] ─┼─ update ─ publish
                   └─ ...                                      ┘

Keys are ``<stage>-<iteration>[-<shard>]`` (``task_keys.py``), so the stage of each task is
read back for timings and for colouring the rendered graph. Placement, by annotation (Dask
resources): dedup and shard run on the ``TRAIN`` worker, generate, reward and advantage on
the generation pool (``GEN``), update and publish on ``TRAIN``. The trainer is idle when a
batch's generation is submitted (between updates; in async mode the runner waits for the
shards before it submits the update), and the shards it holds pull each generate task to
whichever generation worker is least busy: Dask runs a task where its inputs are, so shards
made on one generation worker would all be generated there, and dedup left free to land
anywhere could also land on a trainer busy with an update, holding back the next batch.
Groups never straddle shards, so advantages are computed per shard, as soon as that shard is
scored. Given the elastic policy, each generate task declares its predicted work to the
scheduler (``plugin.generation_work``): an equal share of its batch's, as the shards
are cut on the trainer after the graph is submitted (``split_balanced``: equal prompt
tokens).

``update_graph`` is the one update-then-publish step of every iteration, whatever produced
its trainable shards (this graph's delayed tasks, or futures of the elastic controller), and
``submit_update`` submits it: the runner of every mode (``modes.py``) goes through it.
``iteration_graph`` joins the two halves into the whole iteration that ``rlhfless graph``
renders.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import dask
import pyarrow as pa
from dask.delayed import Delayed, delayed
from distributed import Client, Future

from rlhfless.ops.data.prefix_dedup import PrefixPlan, plan_prefixes
from rlhfless.ops.data.shard import split_balanced
from rlhfless.ops.engine.engine_types import WeightsRef
from rlhfless.ops.engine.seeds import generation_seed
from rlhfless.schedulers.dask.plugin import generation_work
from rlhfless.schedulers.scaling_policy import ScalingPolicy

from ..task_keys import task_key
from ..tasks.rollout import GenSpec, generate_task
from ..tasks.scoring import RewardSpec, advantage_task, reward_task
from ..tasks.trainer import TrainSpec, publish_task, update_task


@dataclass(frozen=True)
class IterationGraph:
    plan: Delayed  # PrefixPlan
    trainables: list[Delayed]  # one Generated (trainable table + statistics) per shard
    metrics: Delayed  # dict from the update
    weights: Delayed  # WeightsRef of the new version

    def outputs(self) -> list[Delayed]:
        return [self.plan, *self.trainables, self.metrics, self.weights]


def _shard_plan(plan: PrefixPlan, n_shards: int) -> list[pa.Table]:
    return split_balanced(plan.prompts, n_shards)


def shard_work(scaling: ScalingPolicy | None, prompts: pa.Table, n_samples: int, n_shards: int):
    """``generation_work`` of one of ``n_shards`` shards of ``prompts``: an equal share of
    their predicted work, as one unit (a task is never split); without a policy, none."""
    if scaling is None:
        return nullcontext()
    tokens, longest, prompt_tokens = scaling.predict_work(
        prompts.column("prompt_id").to_pylist(),
        [len(p) for p in prompts.column("prompt_ids").to_pylist()], n_samples)
    return generation_work([tokens.sum() / n_shards], [longest.max(initial=0.0)],
                           [prompt_tokens.sum() / n_shards])


def rollout_graph(prompts, weights: WeightsRef, iteration: int, n_shards: int,
                  gen: GenSpec, reward: RewardSpec, *, seed: int, min_prefix: int,
                  tag: str = "", target_version: int | None = None,
                  scaling: ScalingPolicy | None = None,
                  ) -> tuple[Delayed, list[Delayed], list[Delayed]]:
    """dedup → shard → generate → reward for ``prompts``; returns (plan, shards, scored
    shards). ``seed``: the run's; every shard generates under ``generation_seed(seed,
    iteration)``. ``target_version``: the trainer version that consumes them (async mode;
    see ``generate_task``). ``policy``: predicts the work each generate task declares."""
    gen_seed = generation_seed(seed, iteration)
    with dask.annotate(resources={"TRAIN": 1}):
        plan = delayed(plan_prefixes)(prompts, gen.n_samples, min_prefix,
                                      dask_key_name=task_key("dedup", iteration, tag=tag))
        split = delayed(_shard_plan, nout=n_shards)(
            plan, n_shards, dask_key_name=task_key("shard", iteration, tag=tag))
        shards = [split[i] for i in range(n_shards)]
    scored = []
    with dask.annotate(resources={"GEN": 1}):
        for i, shard in enumerate(shards):
            with shard_work(scaling, prompts, gen.n_samples, n_shards):
                rollouts = delayed(generate_task)(
                    shard, weights, gen, gen_seed, target_version,
                    dask_key_name=task_key("generate", iteration, i, tag=tag))
            scored.append(delayed(reward_task)(
                rollouts, reward, dask_key_name=task_key("reward", iteration, i, tag=tag)))
    return plan, shards, scored


def trainable_graph(prompts, weights: WeightsRef, iteration: int, n_shards: int,
                    gen: GenSpec, reward: RewardSpec, *, algorithm: str, seed: int,
                    min_prefix: int, target_version: int | None = None,
                    scaling: ScalingPolicy | None = None, turn_credit: str = "episode",
                    ) -> tuple[Delayed, list[Delayed], list[Delayed]]:
    """``rollout_graph`` → advantage: returns (plan, shards, one trainable table per
    shard)."""
    plan, shards, scored = rollout_graph(prompts, weights, iteration, n_shards, gen, reward,
                                         seed=seed, min_prefix=min_prefix,
                                         target_version=target_version, scaling=scaling)
    with dask.annotate(resources={"GEN": 1}):
        trainables = [
            delayed(advantage_task)(s, algorithm, gen.n_samples, turn_credit,
                                    dask_key_name=task_key("advantage", iteration, i))
            for i, s in enumerate(scored)
        ]
    return plan, shards, trainables


def update_graph(trainables: list, weights: WeightsRef, train: TrainSpec,
                 iteration: int) -> tuple[Delayed, Delayed]:
    """update → publish on the trainer (``TRAIN``): the update of ``iteration`` on
    ``trainables`` (delayed tasks or futures, one ``Generated`` each) from ``weights``, then
    the publication of version ``weights.version + 1``. Returns (metrics, new weights)."""
    with dask.annotate(resources={"TRAIN": 1}):
        metrics = delayed(update_task)(trainables, weights, train,
                                       dask_key_name=task_key("update", iteration))
        published = delayed(publish_task)(metrics, train, weights.version + 1,
                                          dask_key_name=task_key("publish", iteration))
    return metrics, published


def submit_update(client: Client, trainables: list, weights: WeightsRef, train: TrainSpec,
                  iteration: int) -> tuple[Future, Future]:
    """``update_graph`` submitted: futures of (metrics, new weights)."""
    metrics, published = client.compute(
        list(update_graph(trainables, weights, train, iteration)), optimize_graph=False)
    return metrics, published


def iteration_graph(prompts, weights: WeightsRef, iteration: int, n_shards: int,
                    gen: GenSpec, reward: RewardSpec, train: TrainSpec, *, algorithm: str,
                    seed: int, min_prefix: int) -> IterationGraph:
    """The whole graph of one sync iteration, producing version ``weights.version + 1``: what
    ``rlhfless graph`` renders. A run submits the same tasks in two halves (``ModeRunner``:
    ``trainable_graph``, then ``submit_update``)."""
    plan, _, trainables = trainable_graph(prompts, weights, iteration, n_shards, gen, reward,
                                          algorithm=algorithm, seed=seed, min_prefix=min_prefix)
    metrics, new_weights = update_graph(trainables, weights, train, iteration)
    return IterationGraph(plan, trainables, metrics, new_weights)
