"""The one driver of every mode: an iteration as a producer–consumer pipeline of futures.

``ModeRunner.step(j)`` runs iteration j: update j trains on batch j at the trainer's version
``v_{j-1}`` and, while it runs, the generation pool is kept busy with the next ``ahead``
batches::

    step j:  submit batches j+1 .. j+ahead with v_{j-1}   (generated on the pool)
             submit update j on batch j                   (v_{j-1} -> v_j, on the trainer)
             wait for update j

A batch is generated through one seam (``generation.py``): by the static policy's graph
(``GraphGeneration``: dedup → shard → generate → reward → advantage, non-blocking futures)
or by the elastic controller (``ElasticGeneration``: blocking, decided as it runs); the
update and the publication of the new version are ``graph.submit_update``, the one
update-and-publish path. Reward and advantage of a shard start as soon as that shard is
generated. A batch's graph dedups and shards on the trainer, so the runner waits for the
shards of a batch generated ahead (milliseconds) before it submits the update
(``shards_ahead_first``); the elastic controller generates in this process instead, so there
the update goes first and the next batch is generated while it runs.

``mode = "sync"``: ``ahead = 0`` and no replay. Batch j is generated in step j with
``v_{j-1}``, then trained on: every sample is on-policy, checked per sample (staleness 0) on
the trainer before the step (``update_task``) and here again.

``mode = "async"`` (AsyncFlow: bounded staleness): ``ahead = max_staleness``. Batch i may
come from any published version ``v_p`` with ``i - 1 - p <= max_staleness``. With
``max_staleness = 1`` this is one-step-off: while update k runs, batch k+1 is generated with
``v_{k-1}``.

``mode = "replay"`` (ReFlow: experience replay). Generation is synchronous, but each batch
takes up to ``round(replay_ratio * batch_prompts)`` groups (at most ``batch_prompts - 1``)
from a ``ReplayBuffer`` of informative groups at most ``replay_max_age`` versions old (0,
the default: 2) and generates only the rest (*replace*). Generation demand shrinks with
it: the static graph's shards get fewer prompts, and the elastic policy sizes its pool from
the prompts actually generated. After the update the fresh groups join the buffer.

Which prompts the replayed groups replace: by default the last of the batch in data order
(they are drawn by the next batch instead). With ``replay_longest = true`` a whole batch is
drawn and the prompts predicted longest are replaced (``_replace_longest``): decode time
follows the batch's longest sequence, not its row count, so dropping the longest prompts
shortens generation more than dropping as many random ones. The prediction is the length
predictor's longest sample of the group (``schedulers/predictor.py``); for prompts it has
not seen, whose predictions are all the same fallback, the longer prompt ranks first. A
replaced prompt is not generated at that draw (the data moves on a whole batch), so long
prompts are trained fresh less often: ``replay_max_skips`` bounds it, a prompt replaced at
its last ``replay_max_skips`` draws in a row is generated fresh at the next
(``ReplayBuffer.replace``). The decision record says which predicted lengths were replaced.
Off by default, because it costs quality: the longest prompts are the hardest, so the fresh
groups left are mostly solved, and within one epoch a replaced prompt is never trained fresh
(``bench/modes.py`` measures it; figures in docs/benchmarks.md, "Length-aware replay").

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
iteration record carries the diagnostics of ``ops/replay/stats.py`` (advantage drift,
gradient share, ages, diversity) and the update's importance weights of the replayed rows
(``tis_weight_mean_older``).

In async+replay, fresh rows lag at most ``max_staleness`` versions, replayed ones at most
``replay_max_age``, which must be at least ``2 * max_staleness + 1`` (the default, 0, is
that): batch j, generated with ``v_{j-1-s}`` (s = max_staleness), joins the buffer after
update j, when the batch being drawn is j+1+s, for trainer ``v_{j+s}``, so its groups are
``2s + 1`` versions old there.

In every mode every row keeps the ``policy_version`` that generated it (replayed rows too);
the trainer corrects with truncated importance sampling (``ops/algo/offpolicy.py``, cap
``tis_cap``; none in sync mode, where every row is on-policy); staleness is checked per
sample on the trainer before the step (``update_task``) and here again, and recorded
(``staleness_mean``, ``staleness_max``). Both scheduling policies work in every mode.

Update j is submitted by step j and by nothing earlier, so between steps the trainer holds
exactly the version the loop reports: checkpoints and trainer checks see a settled trainer.

Checkpoint state: the runner's ``state_dict`` (which ``Durable`` saves with each checkpoint,
``Durable.track``) holds ``mode_state`` (one row: ``sampler_position``, the data position of
the batches consumed so far, ``iteration``, and the share policy's smoothed seconds
``share_gen_s``, ``share_update_s`` and ``share_informative``, null before a
measurement) and, in replay mode, the buffer's
``replay_rows`` and ``replay_groups`` (``ReplayBuffer.state_dict``). When the loop goes back
to a checkpoint (resume, recovery), the next ``step`` sees the jump, drops the batches in
flight and loads the restored tables (``load_state_dict``); batches generated ahead are drawn again.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
from distributed import Future

from rlhfless.ops.algo.offpolicy import check_staleness
from rlhfless.ops.engine.engine_types import WeightsRef
from rlhfless.ops.engine.gen_stats import Generated
from rlhfless.ops.replay.buffer import ReplayBuffer
from rlhfless.ops.replay.stats import replay_diagnostics
from rlhfless.schedulers.replay_share import ReplayShare

from ..config import Config
from ..report.bookkeeping import observe_iteration
from ..report.metrics import iteration_record
from ..task_keys import iteration_of
from .graph import submit_update

if TYPE_CHECKING:
    from ..cluster.pools import PoolCluster
    from ..durable.recovery import Durable
    from ..durable.sampler import PromptSampler
    from ..specs import Specs
    from .generation import Generation


def mode_specs(specs: Specs, cfg: Config) -> Specs:
    """``specs`` for ``cfg.mode``: the staleness bounds of generation and update, the TIS
    cap, and the published versions kept (an async batch may use one ``max_staleness``
    versions old while newer ones are published)."""
    gen_bound = cfg.max_staleness if cfg.overlaps else 0
    train_bound = max(gen_bound, cfg.replay_age if cfg.replays else 0)
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
    """Runs the iterations of every mode (``cfg.mode``); see the module docstring."""

    def __init__(self, cfg: Config, pc: PoolCluster, generation: Generation, specs: Specs,
                 sampler: PromptSampler, durable: Durable | None = None) -> None:
        self.cfg, self.pc, self.specs, self.sampler, self.durable = cfg, pc, specs, sampler, durable
        self.generation = generation
        self.ahead = cfg.max_staleness if cfg.overlaps else 0
        self.buffer = self._new_buffer()
        self.share = ReplayShare(cfg.batch_prompts, cfg.replay_ratio,
                                 mix="fill" if cfg.overlaps else "replace",
                                 sharing=cfg.replay_share,
                                 max_grad_share=cfg.replay_max_grad_share)
        self.log_decision, self.scaling = generation.log, generation.scaling
        self.jobs: dict[int, Job] = {}
        self.expected = self.next = 1  # the next step, and the next batch to generate
        self.consumed = sampler.position  # data position of the batches trained so far
        pc.client.get_task_stream(start=time.time())  # start recording task spans

    def _new_buffer(self) -> ReplayBuffer | None:
        if not self.cfg.replays:
            return None
        return ReplayBuffer(self.cfg.replay_size, self.cfg.replay_age, seed=self.cfg.seed,
                            age_decay=self.cfg.replay_age_decay,
                            max_skips=self.cfg.replay_max_skips)

    # ---- the loop's side ---------------------------------------------------------------

    def step(self, iteration: int, weights: WeightsRef) -> tuple[dict, pa.Table, WeightsRef]:
        """Train iteration ``iteration`` from ``weights`` (the trainer's current version);
        returns its record, the rows generated for it, and the new weights."""
        if iteration != self.expected:
            self._restart(iteration)
        started = time.time()
        try:
            self._generate_until(iteration, weights, iteration)
            if self.generation.shards_ahead_first:
                self._generate_until(iteration + self.ahead, weights, iteration)
            self._submit_update(self.jobs[iteration], weights)
            self._generate_until(iteration + self.ahead, weights, iteration)
            # the batch stays among the jobs until it is finished: a failure releases it too
            done = self._finish(self.jobs[iteration], weights, started)
            del self.jobs[iteration]
            return done
        except BaseException:
            self.close()
            raise

    def set_lr(self, lr: float) -> None:
        """Update with learning rate ``lr`` from the next step on (a rollback lowers it)."""
        train = self.specs.train
        train = dataclasses.replace(train, update=dataclasses.replace(train.update, lr=lr))
        self.specs = dataclasses.replace(self.specs, train=train)

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

    def load_state_dict(self, tables: dict[str, pa.Table]) -> None:
        """Back to ``state_dict``'s tables (none: the run's start)."""
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

    # ---- producer ----------------------------------------------------------------------

    def _restart(self, iteration: int) -> None:
        """Back to the restored checkpoint's state (``Durable.restored_tables``), at
        ``iteration``."""
        self.close()
        self.expected = self.next = iteration
        self.load_state_dict(self.durable.restored_tables if self.durable is not None else {})

    def _generate_until(self, last: int, weights: WeightsRef, iteration: int) -> None:
        """Start the batches up to ``last`` with ``weights``, the trainer's version at
        ``iteration``: batch i is consumed at version ``weights.version + i - iteration``."""
        while self.next <= min(last, self.cfg.iterations):
            i = self.next
            self.jobs[i] = self._generate(i, weights.version + i - iteration, weights)
            self.next += 1

    def _generate(self, i: int, target: int, weights: WeightsRef) -> Job:
        batch, replayed = self._draw(i, target)
        submitted = time.time()
        out = self.generation.generate(batch, weights, i, target, self.specs, self.cfg.seed)
        return Job(i, target, weights, len(batch), replayed, out.plan, out.trainables,
                   out.facts, submitted, self.sampler.position, out.shards)

    def _draw(self, i: int, target: int) -> tuple[pa.Table, list[pa.Table]]:
        """Batch ``i``'s fresh prompts and replayed groups, for trainer ``v{target}``: as
        many replayed as the share policy decides and the buffer holds (replace: fresh
        prompts fill what the buffer lacks), none of a prompt fresh in the batch."""
        if self.buffer is None:
            return self.sampler.next_batch(), []
        decision = self.share.decide()
        if self.cfg.replay_longest:
            batch, replayed, facts = self._replace_longest(decision.replayed, target)
        else:
            batch, facts = self.sampler.next_batch(decision.fresh), {}
            replayed = self.buffer.sample(decision.replayed, target,
                                          exclude=batch.column("prompt_id").to_pylist())
        if len(batch) + len(replayed) < self.cfg.batch_prompts:
            more = self.sampler.next_batch(self.cfg.batch_prompts - len(batch) - len(replayed))
            batch = pa.concat_tables([batch, more])
        self.log_decision(i, pool="replay", kind="replay_share", mix=self.share.mix,
                          sharing=self.share.sharing, target_version=target,
                          max_age=self.cfg.replay_age, buffer_groups=len(self.buffer),
                          drawn=len(replayed), **decision.to_record(), **facts)
        return batch, replayed

    def _replace_longest(self, n: int, target: int) -> tuple[pa.Table, list[pa.Table], dict]:
        """A whole batch drawn, its ``n`` prompts predicted longest replaced by replayed
        groups (``ReplayBuffer.replace``): the predictor's longest sample of the group, ties
        (prompts it has not seen) broken by the longer prompt."""
        batch = self.sampler.next_batch()
        ids = batch.column("prompt_id").to_pylist()
        predicted = self.scaling.predict(ids)[1]
        tokens = np.array([len(p) for p in batch.column("prompt_ids").to_pylist()])
        order = np.lexsort((-tokens, -predicted))  # longest first
        replaced, replayed = self.buffer.replace([ids[k] for k in order], n, target)
        gone = order[replaced]
        fresh = np.setdiff1d(np.arange(len(ids)), gone)
        facts = {"longest": True, "replaced_predicted_max": predicted[gone].tolist(),
                 "fresh_predicted_max": float(predicted[fresh].max()),
                 "replaced_prompt_tokens": tokens[gone].tolist(),
                 "fresh_prompt_tokens_max": int(tokens[fresh].max())}
        return batch.take(fresh), replayed, facts

    # ---- consumer ----------------------------------------------------------------------

    def _submit_update(self, job: Job, weights: WeightsRef) -> None:
        if job.target != weights.version:
            raise RuntimeError(f"iteration {job.iteration}: batch generated for trainer "
                               f"v{job.target}, but the trainer is at v{weights.version}")
        extra = [Generated(pa.concat_tables(job.replayed))] if job.replayed else []
        job.update, job.published = submit_update(self.pc.client, [*job.trainables, *extra],
                                                  weights, self.specs.train, job.iteration)

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
            lags.append(check_staleness(replayed, weights.version, self.cfg.replay_age,
                                        f"{where} (replayed)"))
        lag = np.concatenate(lags)
        record |= {"samples": len(lag), "fresh_prompts": job.prompts,
                   "fresh_samples": len(fresh), "replayed_groups": len(job.replayed),
                   "replayed_samples": len(lag) - len(fresh),
                   "generated_by": job.weights.version,
                   "weights_bytes": new_weights.nbytes,  # the version this update published
                   "staleness_mean": float(lag.mean()), "staleness_max": int(lag.max()),
                   **job.facts}
        timings = self.generation.after_update(update["update_seconds"],
                                               [t.stats for t in trainables])
        record |= observe_iteration(self.scaling, fresh, timings)
        if self.buffer is not None:
            record |= replay_diagnostics(fresh, job.replayed, weights.version)
            record["replay_share"] = len(job.replayed) / (job.prompts + len(job.replayed))
            gen_s = record.get("generation_s", record.get("generate_wall_s", 0.0))
            self.share.observe(gen_s, job.prompts, update["update_seconds"],
                               job.prompts + len(job.replayed), record["fresh_informative_frac"])
            self.buffer.add(fresh)
            record["replay_buffer_groups"] = len(self.buffer)
        self.expected, self.consumed = job.iteration + 1, job.position
        return record, fresh, new_weights

