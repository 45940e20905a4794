"""Async and replay modes: the training iteration as a producer–consumer pipeline of futures.

``mode = "async"`` (AsyncFlow: bounded staleness). Update i trains on batch i at the
trainer's version ``v_{i-1}``; batch i may come from any published version ``v_p`` with
``i - 1 - p <= max_staleness``. ``ModeRunner.step(j)`` runs update j and, while it runs,
keeps the generation pool busy with the next batches::

    step j:  submit batches j+1 .. j+max_staleness with v_{j-1}   (generated on the pool)
             submit update j on batch j            (v_{j-1} -> v_j, on the trainer)
             wait for update j

With ``max_staleness = 1`` this is one-step-off: while update k runs, batch k+1 is generated
with ``v_{k-1}``. Reward and advantage of a shard start as soon as that shard is generated
(the per-shard tasks of ``graph.trainable_graph``, or the elastic controller's streaming).
A batch's graph dedups and shards on the trainer (``graph``), so the runner waits for its
shards (milliseconds) before it submits the update; the elastic controller generates in this
process instead, so there the update goes first.

``mode = "replay"`` (ReFlow: experience replay). Generation is synchronous, but each batch
takes up to ``round(replay_ratio * batch_prompts)`` groups (at most ``batch_prompts - 1``)
from a ``ReplayBuffer`` of informative groups at most ``replay_max_age`` versions old and
generates only the rest (*replace*). Generation demand shrinks with it: the static graph's
shards get fewer prompts, and the elastic policy sizes its pool from the prompts actually
generated. After the update the fresh groups join the buffer.

``mode = "async+replay"`` does both: batches are generated ahead as in async mode, and each
takes its replayed groups from the buffer when it is drawn (fresh groups join the buffer
when their update is done, so a batch drawn ahead does not see the groups of the update
running beside it). Here the replayed groups come *on top of* a whole fresh batch (*fill*):
they use the trainer's idle time while the next batch is generated, and never displace
fresh data.

How many groups are replayed is the decision of ``schedulers/replay_share.py``: with
``replay_share = "adaptive"`` it follows the measured generation/update balance (more replay
when generation is the bottleneck), with ``"fixed"`` it is ``replay_ratio`` of the batch;
each decision is a record in ``decisions.jsonl`` (``pool = "replay"``) and the share is in
the iteration's record (``replay_share``). A prompt fresh in a batch is never replayed in it
(``ReplayBuffer.sample(exclude=...)``); ``replay_age_decay`` < 1 prefers younger groups. The
iteration record carries the diagnostics of ``ops/replay_stats.py`` (advantage drift,
gradient share, ages, diversity) and the update's importance weights of the replayed rows
(``tis_weight_mean_older``).

In async+replay, fresh rows lag at most ``max_staleness`` versions, replayed ones at most
``replay_max_age``, which must be at least ``2 * max_staleness + 1``: batch j, generated with
``v_{j-1-s}`` (s = max_staleness), joins the buffer after update j, when the batch being
drawn is j+1+s, for trainer ``v_{j+s}``, so its groups are ``2s + 1`` versions old there.

In every mode every row keeps the ``policy_version`` that generated it (replayed rows too);
the trainer corrects with truncated importance sampling (``ops/offpolicy.py``, cap
``tis_cap``); staleness is checked per sample on the trainer before the step
(``update_task``) and here again, and recorded (``staleness_mean``, ``staleness_max``).
Generation comes from the static graph (non-blocking futures) or from the elastic controller
(blocking: the driver generates the next batch while the update runs on the trainer), so
both scheduling policies work.

Update j is submitted by step j and by nothing earlier, so between steps the trainer holds
exactly the version the loop reports: checkpoints and trainer checks see a settled trainer.

Checkpoint state: after every step the runner leaves its state in ``durable.tables`` (saved
with each checkpoint): ``mode_state`` (one row: ``sampler_position``, the data position of
the batches consumed so far, ``iteration``, and the share policy's smoothed seconds
``share_gen_s``, ``share_update_s`` and ``share_informative``, null before a
measurement) and, in replay mode, the buffer's
``replay_rows`` and ``replay_groups`` (``ReplayBuffer.state_dict``). When the loop goes back
to a checkpoint (resume, recovery), the next ``step`` sees the jump, drops the batches in
flight and restores from ``durable.tables``; batches generated ahead are drawn again.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
from distributed import Future, wait

from rlhfless.ops.gen_stats import Generated
from rlhfless.ops.offpolicy import check_staleness
from rlhfless.ops.publish import WeightsRef
from rlhfless.ops.replay import ReplayBuffer
from rlhfless.ops.replay_stats import replay_diagnostics
from rlhfless.schedulers.replay_share import ReplayShare

from .config import Config
from .graph import trainable_graph
from .metrics import iteration_record
from .task_keys import iteration_of, task_key
from .trainer_tasks import publish_task, update_task

if TYPE_CHECKING:
    from .cluster import PoolCluster
    from .elastic import ElasticGeneration
    from .recovery import Durable
    from .sampler import PromptSampler
    from .specs import Specs


def mode_specs(specs: Specs, cfg: Config) -> Specs:
    """``specs`` for ``cfg.mode``: the staleness bounds of generation and update, the TIS
    cap, and the published versions kept (an async batch may use one ``max_staleness``
    versions old while newer ones are published)."""
    gen_bound = cfg.max_staleness if cfg.overlaps else 0
    train_bound = max(gen_bound, cfg.replay_max_age if cfg.replays else 0)
    update = specs.train.update
    if cfg.mode != "sync":
        update = dataclasses.replace(update, tis_cap=cfg.tis_cap)
    train = dataclasses.replace(specs.train, update=update, max_staleness=train_bound,
                                keep_versions=max(cfg.keep_weights, gen_bound + 2))
    return dataclasses.replace(specs, train=train,
                               gen=dataclasses.replace(specs.gen, max_staleness=gen_bound))


@dataclass
class Job:
    """One batch on its way through the pipeline."""

    iteration: int
    target: int  # the trainer version that consumes it
    weights: WeightsRef  # the policy that generates it
    prompts: int  # prompts generated fresh
    replayed: list[pa.Table]  # groups from the replay buffer
    plan: Any  # PrefixPlan, or its future
    trainables: list[Future]  # one trainable table per shard
    facts: dict  # the elastic controller's generation facts
    submitted: float
    position: int  # the sampler's position once this batch was drawn
    shards: list[Future] = dataclasses.field(default_factory=list)  # on the trainer
    update: Future | None = None
    published: Future | None = None

    def futures(self) -> list[Future]:
        maybe = [self.plan, *self.shards, *self.trainables, self.update, self.published]
        return [f for f in maybe if isinstance(f, Future)]


class ModeRunner:
    """Runs the iterations of the async and replay modes; see the module docstring."""

    def __init__(self, cfg: Config, pc: PoolCluster, eg: ElasticGeneration, specs: Specs,
                 sampler: PromptSampler, durable: Durable | None = None) -> None:
        self.cfg, self.pc, self.specs, self.sampler, self.durable = cfg, pc, specs, sampler, durable
        self.eg = eg if cfg.policy == "elastic" else None
        self.ahead = cfg.max_staleness if cfg.overlaps else 0
        self.buffer = self._new_buffer()
        self.share = ReplayShare(cfg.batch_prompts, cfg.replay_ratio,
                                 mix="fill" if cfg.overlaps else "replace",
                                 sharing=cfg.replay_share,
                                 max_grad_share=cfg.replay_max_grad_share)
        self.log_decision, self.policy = eg.log, eg.policy
        self.jobs: dict[int, Job] = {}
        self.expected = self.next = 1  # the next step, and the next batch to generate
        self.consumed = sampler.position  # data position of the batches trained so far
        pc.client.get_task_stream(start=time.time())  # start recording task spans

    def _new_buffer(self) -> ReplayBuffer | None:
        if not self.cfg.replays:
            return None
        return ReplayBuffer(self.cfg.replay_size, self.cfg.replay_max_age, seed=self.cfg.seed,
                            age_decay=self.cfg.replay_age_decay)

    # ---- the loop's side ---------------------------------------------------------------

    def step(self, iteration: int, weights: WeightsRef) -> tuple[dict, pa.Table, WeightsRef]:
        """Train iteration ``iteration`` from ``weights`` (the trainer's current version);
        returns its record, the rows generated for it, and the new weights."""
        if iteration != self.expected:
            self._restart(iteration)
        started = time.time()
        try:
            self._generate_until(iteration, weights, iteration)
            if self.eg is None:  # the graphs ahead shard on the trainer: before the update
                self._generate_until(iteration + self.ahead, weights, iteration)
            self._submit_update(self.jobs[iteration], weights)
            self._generate_until(iteration + self.ahead, weights, iteration)
            return self._finish(self.jobs.pop(iteration), weights, started)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Let go of every batch in flight (the scheduler forgets what no one wants); the
        next ``step`` starts over from the state."""
        for job in self.jobs.values():
            for future in job.futures():
                future.release()
        self.jobs.clear()
        self.expected = 0

    def state_dict(self) -> dict[str, pa.Table]:
        """The runner's checkpoint tables (see the module docstring)."""
        tables = {"mode_state": pa.table({"sampler_position": [self.consumed],
                                          "iteration": [self.expected - 1],
                                          "share_gen_s": pa.array([self.share.gen_s],
                                                                  pa.float64()),
                                          "share_update_s": pa.array([self.share.update_s],
                                                                     pa.float64()),
                                          "share_informative": pa.array(
                                              [self.share.informative], pa.float64())})}
        if self.buffer is not None:
            tables |= self.buffer.state_dict()
        return tables

    # ---- producer ----------------------------------------------------------------------

    def _restart(self, iteration: int) -> None:
        """Back to the state in ``durable.tables`` (a restored checkpoint's), at
        ``iteration``."""
        self.close()
        self.expected = self.next = iteration
        tables = self.durable.tables if self.durable is not None else {}
        if "mode_state" in tables:
            state = tables["mode_state"]
            self.sampler.position = int(state.column("sampler_position")[0])
            if "share_gen_s" in state.column_names:
                self.share.gen_s = state.column("share_gen_s")[0].as_py()
                self.share.update_s = state.column("share_update_s")[0].as_py()
                self.share.informative = state.column("share_informative")[0].as_py()
        self.consumed = self.sampler.position
        self.buffer = self._new_buffer()
        if self.buffer is not None and "replay_groups" in tables:
            self.buffer.load_state_dict(tables)

    def _generate_until(self, last: int, weights: WeightsRef, iteration: int) -> None:
        """Start the batches up to ``last`` with ``weights``, the trainer's version at
        ``iteration``: batch i is consumed at version ``weights.version + i - iteration``."""
        while self.next <= min(last, self.cfg.iterations):
            i = self.next
            self.jobs[i] = self._generate(i, weights.version + i - iteration, weights)
            self.next += 1

    def _generate(self, i: int, target: int, weights: WeightsRef) -> Job:
        batch, replayed = self._draw(i, target)
        seed, submitted, shards, facts = self.cfg.seed, time.time(), [], {}
        if self.eg is not None:  # blocking: overlaps the update already submitted
            plan, trainables, facts = self.eg.run_generation(batch, weights, i, self.specs, seed)
        else:  # the batch travels in the graph: a worker's death must not lose it
            plan, parts, tables = trainable_graph(
                batch, weights, i, self.cfg.gen_workers, self.specs.gen, self.specs.reward,
                algorithm=self.cfg.algorithm, seed=seed, min_prefix=self.cfg.min_prefix,
                target_version=target, policy=self.policy)
            plan, *futures = self.pc.client.compute([plan, *parts, *tables],
                                                    optimize_graph=False)
            shards, trainables = futures[: len(parts)], futures[len(parts):]
            wait(shards)  # made on the trainer, which an update submitted next would hold
        return Job(i, target, weights, len(batch), replayed, plan, trainables, facts,
                   submitted, self.sampler.position, shards)

    def _draw(self, i: int, target: int) -> tuple[pa.Table, list[pa.Table]]:
        """Batch ``i``'s fresh prompts and replayed groups, for trainer ``v{target}``: as
        many replayed as the share policy decides and the buffer holds (replace: fresh
        prompts fill what the buffer lacks), none of a prompt fresh in the batch."""
        if self.buffer is None:
            return self.sampler.next_batch(), []
        decision = self.share.decide()
        batch = self.sampler.next_batch(decision.fresh)
        replayed = self.buffer.sample(decision.replayed, target,
                                      exclude=batch.column("prompt_id").to_pylist())
        if decision.fresh + len(replayed) < self.cfg.batch_prompts:
            more = self.sampler.next_batch(self.cfg.batch_prompts - decision.fresh
                                           - len(replayed))
            batch = pa.concat_tables([batch, more])
        self.log_decision(i, pool="replay", kind="replay_share", mix=self.share.mix,
                          sharing=self.share.sharing, target_version=target,
                          max_age=self.cfg.replay_max_age, buffer_groups=len(self.buffer),
                          drawn=len(replayed), **decision.to_record())
        return batch, replayed

    # ---- consumer ----------------------------------------------------------------------

    def _submit_update(self, job: Job, weights: WeightsRef) -> None:
        if job.target != weights.version:
            raise RuntimeError(f"iteration {job.iteration}: batch generated for trainer "
                               f"v{job.target}, but the trainer is at v{weights.version}")
        client = self.pc.client
        extra = [Generated(pa.concat_tables(job.replayed))] if job.replayed else []
        job.update = client.submit(update_task, [*job.trainables, *extra], weights,
                                   self.specs.train, key=task_key("update", job.iteration),
                                   resources={"TRAIN": 1})
        job.published = client.submit(publish_task, job.update, self.specs.train,
                                      weights.version + 1,
                                      key=task_key("publish", job.iteration),
                                      resources={"TRAIN": 1})

    def _finish(self, job: Job, weights: WeightsRef,
                started: float) -> tuple[dict, pa.Table, WeightsRef]:
        client = self.pc.client
        plan, trainables, update, new_weights = client.gather(
            [job.plan, job.trainables, job.update, job.published])
        stream = [t for t in client.get_task_stream(start=job.submitted)
                  if iteration_of(t["key"]) == job.iteration]
        record, fresh = iteration_record(job.iteration, weights.version, started, plan,
                                         trainables, update, stream)
        where = f"iteration {job.iteration}"
        lags = [check_staleness(fresh, weights.version, self.ahead, where)]
        if job.replayed:
            replayed = pa.concat_tables(job.replayed)
            lags.append(check_staleness(replayed, weights.version, self.cfg.replay_max_age,
                                        f"{where} (replayed)"))
        lag = np.concatenate(lags)
        record |= {"samples": len(lag), "fresh_prompts": job.prompts,
                   "fresh_samples": len(fresh), "replayed_groups": len(job.replayed),
                   "replayed_samples": len(lag) - len(fresh),
                   "generated_by": job.weights.version,
                   "staleness_mean": float(lag.mean()), "staleness_max": int(lag.max()),
                   **job.facts}
        if self.eg is not None:
            self.eg.after_update(update["update_seconds"],
                                 [t.stats for t in trainables])
        if self.buffer is not None:
            record |= replay_diagnostics(fresh, job.replayed, weights.version)
            record["replay_share"] = len(job.replayed) / (job.prompts + len(job.replayed))
            gen_s = record.get("generation_s", record.get("generate_wall_s", 0.0))
            self.share.observe(gen_s, job.prompts, update["update_seconds"],
                               job.prompts + len(job.replayed), record["fresh_informative_frac"])
            self.buffer.add(fresh)
            record["replay_buffer_groups"] = len(self.buffer)
        self.expected, self.consumed = job.iteration + 1, job.position
        if self.durable is not None:
            self.durable.tables = {**self.durable.tables, **self.state_dict()}
        return record, fresh, new_weights


def make_runner(cfg: Config, pc: PoolCluster, eg: ElasticGeneration, specs: Specs,
                sampler: PromptSampler, durable: Durable | None = None) -> ModeRunner | None:
    """The runner of ``cfg.mode``; None in sync mode, whose iterations are
    ``drivers.run_iteration`` and ``drivers.run_elastic_iteration``."""
    if cfg.mode == "sync":
        return None
    return ModeRunner(cfg, pc, eg, specs, sampler, durable)
