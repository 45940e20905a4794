"""Elastic, cost-aware generation: the RLHFless policy applied to the generation pool.

Every decision is taken by ``schedulers.scaling_policy.ScalingPolicy`` (the object the simulator
calls too); this file applies them to the live pools. Per iteration, driven from the
driver with Dask futures (the graph is decided as it runs):

1. predict each prompt's response length (EWMA, ``LengthPredictor``);
2. choose how many generation workers to run and which prompts each gets
   (``ScalingPolicy.plan``: λ·time + (1-λ)·worker-seconds, from a throughput model
   fitted online to this run's own timings), grow or retire the pool to that size;
3. generate each shard in a chunk that pauses at completion fraction τ; for the paused
   tail ``ScalingPolicy.migrate`` decides: resume it where its KV cache is, or cut it and continue
   it on other workers; ``ScalingPolicy.kv_path`` decides per move whether its KV cache
   travels there (exported on the source, fetched worker to worker by the target:
   ``tasks/tail.py``) or its prefix is recomputed there, from the transfer and prefill
   rates fitted to the run's own moves (an engine that cannot export its KV cache, vLLM
   or the emulated one, recomputes); with an engine that can also split a paused batch and
   consolidate tails (ours), the first chunk back pauses the whole pool and the policy
   chooses for all its tails at once: stay, move, split or reconfigure
   (``tail_actions.py``, timed by the step profile ``measure_steps`` takes on the pool at
   the first iteration);
4. as soon as a shard is complete, score it and compute its advantages (streaming);
5. release generation workers that would idle longer than a cold start costs (break-even
   keep-alive) — the pool shrinks to what the update needs while the update runs.

Every generation task (a chunk, a resumed or moved tail) declares its predicted work to the
scheduler (``plugin.generation_work``). In the async modes, where there is no
iteration barrier, each batch also installs the policy's sizing rule in the scheduler
(``ScalingPolicy.sizing``): from then on the pool's target follows the queued work
(``ElasticityPlugin``: work that can use more workers than this controller planned, such
as the unpinned tasks of an evaluation, raises it), and once no worker is busy it is the
drained queue, not this controller, that releases the pool (same keep-alive, same veto); a
worker idle while others still generate is this controller's to release, as it places the
tails. The rule's target changes are drained into ``decisions.jsonl`` (``kind =
"queue_target"``). In sync mode the controller releases the pool itself.

Every decision is a record (time, pool, from → to, reason, predicted vs actual) appended to
``decisions.jsonl``; a move's record (path, predicted and actual seconds, bytes) is written
when its context has reached the target, and its actual seconds feed ``ScalingPolicy.kv``
at once (the one observation taken during an iteration, so that its later moves are priced
with it; the rest of what an iteration measured the driver feeds once, after the update:
``after_update`` returns it for ``bookkeeping.observe_iteration``).
A source that dies before its target fetched the exported KV loses nothing: the export, pinned
loosely, reruns elsewhere and finds no paused decoding (``TailLost``), and the move lands
again with its tail recomputed on the target from the cut rows the driver holds (the record's
``landed_by``).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pa_compute

from rlhfless.ops.data.prefix_dedup import plan_prefixes
from rlhfless.ops.data.shard import take_shards
from rlhfless.ops.engine.engine_types import TAIL_ACTIONS, WeightsRef
from rlhfless.ops.engine.gen_stats import GenerationStats
from rlhfless.ops.engine.registry import engine_class
from rlhfless.ops.engine.seeds import generation_seed
from rlhfless.schedulers.dask.plugin import (
    install_sizing,
)
from rlhfless.schedulers.scaling_policy import IterationTimings, ScalingPolicy
from rlhfless.schedulers.tail_cost import TransferModel

from ..cluster.pools import PoolCluster
from ..config import Config
from ..durable.runs import RunDir
from .elastic_round import ElasticRound
from .generation import Generating, Generation
from .step_profile import measure_step_profile


class ElasticGeneration(Generation):
    """Generation of one iteration under the elastic policy; see the module docstring."""

    round_class = ElasticRound  # one call's state and tail handling (elastic_round.py)

    def __init__(self, pc: PoolCluster, cfg: Config, run: RunDir, scaling: ScalingPolicy,
                 rest_workers: float | None = None) -> None:
        """``rest_workers``: generation workers' worth billed while the rest of the step runs
        (default: the trainer's workers)."""
        super().__init__(pc, cfg, run, scaling)
        self.rest_workers = cfg.train_workers if rest_workers is None else rest_workers
        # an engine that cannot export its KV (vllm) moves by recompute
        self.engine = engine = engine_class(cfg.backend)
        self.kv_moves = engine.exports_kv
        self.queue_sizing = cfg.overlaps  # no iteration barrier: the queue sizes the pool
        # what the policy may do with paused tails; split and reconfiguration are timed by
        # a step profile the run measures on its pool (``step_profile.py``)
        self.tail_actions = engine.tail_actions
        self.force_tail = "" if cfg.tail_action == "auto" else cfg.tail_action
        # a reconfiguration's sources leave (threads of one machine), or stay held by its
        # target until it ends (a wider TP over their GPUs: the emulated engine)
        self.reconfig_releases = engine.reconfig_releases
        # wall seconds per second of the engine's clock (the emulated engine's scale)
        self.clock_scale = 1.0 if engine.computes else cfg.emulate_time_scale
        self.declared = False  # the engine's tail actions are logged at the first iteration

    # ---- decisions ---------------------------------------------------------------------

    def scale_pool(self, prompts: pa.Table, iteration: int):
        """Choose the worker count and assignment; grow or retire the pool to match."""
        self.log_queue_targets(iteration)
        if self.queue_sizing:
            sizing = self.scaling.sizing(self.cfg.n_samples, self.cfg.gen_workers,
                                        self.rest_workers)
            self.pc.client.run_on_scheduler(install_sizing, pool="gen", sizing=sizing)
        ids = prompts.column("prompt_id").to_pylist()
        pred, pred_max = self.scaling.predict(ids)
        prompt_tokens = np.array([len(p) for p in prompts.column("prompt_ids").to_pylist()])
        warm = self.pc.worker_names("gen")
        decision = self.scaling.plan(pred, pred_max, self.cfg.n_samples, prompt_tokens,
                                    keep_warm=len(warm), max_workers=self.cfg.gen_workers,
                                    min_workers=self.cfg.gen_min_workers,
                                    rest_workers=self.rest_workers,  # whole-step scoring
                                    pred_env=self.scaling.predict_env(ids))
        n = decision.n_workers
        workers = self.pc.scale("gen", n, close=warm[n:])
        record = {"t": time.time(), "pool": "gen", "kind": "scale", "from": len(warm),
                  "to": len(workers), "prompts": len(ids),
                  "reason": f"argmin λ·T+(1-λ)·C, λ={self.cfg.lambda_cost}",
                  "predicted_s": decision.predicted_seconds,
                  "predicted_worker_s": decision.predicted_cost_ws}
        return decision, workers, record

    # ---- one iteration -----------------------------------------------------------------

    def generate(self, batch: pa.Table, weights: WeightsRef, iteration: int, target: int,
                 specs, seed: int) -> Generating:
        plan, trainables, facts = self.run_generation(batch, weights, iteration, specs, seed)
        return Generating(plan, trainables, facts)

    def run_generation(self, batch: pa.Table, weights: WeightsRef, iteration: int, specs,
                       seed: int) -> tuple[object, list, dict]:
        """Generate, score and compute advantages for ``batch`` under the run ``seed``
        (every task draws under ``generation_seed(seed, iteration)``); returns the dedup
        plan, one future of a trainable table per shard, and generation facts for the
        metrics."""
        self.iteration = iteration
        started = time.time()
        seed = generation_seed(seed, iteration)
        plan = plan_prefixes(batch, self.cfg.n_samples, self.cfg.min_prefix)
        decision, workers, scale_record = self.scale_pool(plan.prompts, iteration)
        shards = take_shards(plan.prompts, decision.assignment)
        ids = plan.prompts.column("prompt_id").to_pylist()
        if self.kv_moves and self.scaling.kv.kv_bytes_per_token is None:  # priors
            self.scaling.kv.kv_bytes_per_token = self.engine.kv_bytes_per_token(specs.gen.engine)
            link = self.engine.kv_link_bytes_per_s(specs.gen.engine)
            if link:
                self.scaling.kv.transfer = TransferModel(prior_bytes_per_s=link)
        if not self.declared:  # once per run: what the tail decision may and may not do
            self.declared = True
            self.log(iteration, pool="gen", kind="tail_actions", backend=self.cfg.backend,
                     supported=sorted(self.tail_actions), refused={
                         a: f"backend {self.cfg.backend!r} cannot {a} a paused tail"
                         for a in TAIL_ACTIONS if a not in self.tail_actions})
        episodes = specs.gen.episodes is not None or specs.gen.agent is not None
        if (len(workers) > 1 and self.scaling.step_profile is None and not episodes
                and {"split", "reconfig"} & self.tail_actions):  # episodes never pause
            self.measure_steps(workers, specs, weights, iteration, plan.prompts)
        round_ = self.round_class(self, iteration, workers,
                                  dict(zip(ids, self.scaling.predict(ids)[1])))
        trainables, migrated, released = round_.run(shards, workers, weights, specs, seed)
        ended = time.time()
        self.pc.sync_events()
        ledger = self.pc.ledger
        scale_record |= {"actual_s": ended - started, "actual_worker_s":
                         ledger.worker_seconds("gen", until=ended)
                         - ledger.worker_seconds("gen", until=started)}
        self.log(iteration, **scale_record)
        released += round_.release_idle()  # generation is over: the update is the idle gap
        self.log_queue_targets(iteration)
        facts = {"gen_workers": len(workers), "migrated_sequences": migrated,
                 "released_during_generation": len(released),
                 "generation_s": time.time() - started,
                 "predicted_generation_s": decision.predicted_seconds}
        return plan, trainables, facts

    def measure_steps(self, workers: list[str], specs, weights: WeightsRef,
                      iteration: int, prompts: pa.Table) -> None:
        """The decode step profile the tail decision is timed by, measured on the pool
        (``measure_step_profile``) and logged. An engine that computes nothing is timed at
        no cost where the tails will run: batches up to the iteration's sequences, its
        prompts' mean length plus a quarter of ``max_new_tokens`` of context."""
        started = time.time()
        if self.engine.computes:
            profile = measure_step_profile(self.pc, workers, specs.gen, weights)
        else:
            n = len(prompts) * self.cfg.n_samples
            context = float(pa_compute.mean(pa_compute.list_value_length(
                prompts.column("prompt_ids"))).as_py() or 0.0) + self.cfg.max_new_tokens / 4
            profile = measure_step_profile(
                self.pc, workers, specs.gen, weights,
                batches=tuple(2 ** k for k in range(max(2, math.ceil(math.log2(n))) + 1)),
                repeats=1, prompt_tokens=int(context))
        self.scaling.step_profile = profile
        self.log(iteration, pool="gen", kind="step_profile", workers=len(workers),
                 seconds=time.time() - started, **profile.to_record())

    def after_update(self, update_seconds: float,
                     shards: list[GenerationStats]) -> IterationTimings:
        """Write the queue's target changes so far; returns what this iteration measured
        (``shards``: each shard's generation statistics) for the driver to feed the policy
        (``bookkeeping.observe_iteration``)."""
        self.log_queue_targets(self.iteration)
        return IterationTimings(update_seconds, shards, self.pc.ledger.cold_starts("gen"))
