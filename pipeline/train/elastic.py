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
   or the emulated one, recomputes);
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

import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa
from distributed import as_completed

from rlhfless.ops.data.prefix_dedup import plan_prefixes
from rlhfless.ops.data.shard import take_shards
from rlhfless.ops.engine.engine_types import WeightsRef
from rlhfless.ops.engine.gen_stats import Generated, GenerationStats
from rlhfless.ops.engine.registry import engine_class
from rlhfless.ops.engine.seeds import generation_seed
from rlhfless.schedulers.dask.plugin import (
    generation_work,
    install_sizing,
)
from rlhfless.schedulers.migration import WorkerProgress
from rlhfless.schedulers.scaling_policy import IterationTimings, ScalingPolicy

from ..cluster.pools import PoolCluster
from ..config import Config
from ..durable.runs import RunDir
from ..task_keys import stage_of, task_key
from ..tasks.rollout import continue_task, drop_task, generate_chunk_task, resume_task
from ..tasks.scoring import advantage_task, reward_task
from ..tasks.tail import (
    TailLost,
    adopt_tails_task,
    export_tail_task,
    move_actual_s,
    resume_adopted_task,
    take_tail_task,
)
from .generation import Generating, Generation


def seq_id(prompt_id: str, sample_idx: int) -> str:
    return f"{prompt_id}#{sample_idx}"


@dataclass(frozen=True)
class TailMove:
    """Rows of a paused tail moved from ``source`` to ``target``, with what continues them
    there: kept until they land, so that a lost export lands them again, recomputed."""

    iteration: int
    shard: int
    index: int  # among the moves of its tail
    source: str
    target: str
    rows: list[int]  # their positions in the cut tail
    part: pa.Table  # the cut rows themselves
    n_tail: int  # rows in the whole cut tail
    weights: WeightsRef
    specs: Any  # the run's task specs (``specs.gen``)
    seed: int

    def key(self, stage: str, tag: str = "") -> str:
        """The key of this move's ``stage`` task (``tag``: of a move landed again)."""
        return task_key(stage, self.iteration, self.shard, self.index, tag=tag)


class ElasticGeneration(Generation):
    """Generation of one iteration under the elastic policy; see the module docstring."""

    def __init__(self, pc: PoolCluster, cfg: Config, run: RunDir, scaling: ScalingPolicy,
                 rest_workers: float | None = None) -> None:
        """``rest_workers``: generation workers' worth billed while the rest of the step runs
        (default: the trainer's workers)."""
        super().__init__(pc, cfg, run, scaling)
        self.rest_workers = cfg.train_workers if rest_workers is None else rest_workers
        # an engine that cannot export its KV (vllm, the emulated one) moves by recompute
        self.kv_moves = engine_class(cfg.backend).exports_kv
        self.queue_sizing = cfg.overlaps  # no iteration barrier: the queue sizes the pool

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
        started, self.iteration = time.time(), iteration
        seed = generation_seed(seed, iteration)
        plan = plan_prefixes(batch, self.cfg.n_samples, self.cfg.min_prefix)
        decision, workers, scale_record = self.scale_pool(plan.prompts, iteration)
        shards = take_shards(plan.prompts, decision.assignment)
        ids = plan.prompts.column("prompt_id").to_pylist()
        self.pred_max = dict(zip(ids, self.scaling.predict(ids)[1]))
        self.load = {w: WorkerProgress(0, 0, busy=False) for w in workers}
        self.pending: dict[int, set] = {}
        self.where: dict[str, tuple[int, str]] = {}  # future key -> (shard, worker)
        self.moving: dict[str, dict] = {}  # key of a move's landing future -> its record
        self.exports: dict[str, list] = {}  # source -> futures of its exported tails
        self.lost: dict[str, TailMove | None] = {}  # a KV move's adopt/continue key -> it
        if self.kv_moves and self.scaling.kv.kv_bytes_per_token is None:  # a prior
            self.scaling.kv.kv_bytes_per_token = engine_class(
                specs.gen.engine.backend).kv_bytes_per_token(specs.gen.engine)
        self.ac = as_completed()
        pieces: dict[int, list[Generated]] = {}
        for i, (shard, worker) in enumerate(zip(shards, workers)):
            if len(shard) == 0:
                continue
            key = task_key("generate", iteration, i)
            work = self.scaling.predict_work(shard.column("prompt_id").to_pylist(), [
                len(p) for p in shard.column("prompt_ids").to_pylist()], self.cfg.n_samples)
            self._submit(i, worker, self.load_of(shard), generate_chunk_task, shard,
                         weights, specs.gen, seed, self.scaling.knobs.tau, key, key=key,
                         work=work)
            pieces[i] = []
        trainables, migrated, released = [], 0, []
        for fut in self.ac:
            if fut.status == "error" and self._reland_lost(fut):
                continue
            if fut.key in self.moving and fut.key not in self.where:  # a KV move landed
                released += self._landed(fut.key, fut.result(), iteration)
                continue
            i, worker = self.where.pop(fut.key)
            self.pending[i].discard(fut.key)
            self.load[worker] = WorkerProgress(0, 0, busy=False)
            out = fut.result()
            if fut.key in self.moving:  # a recomputed continuation: its prefill is the move's
                released += self._landed(fut.key, {
                    "recompute_s": out.stats.prefill_seconds,
                    "recompute_tokens": out.stats.prefill_tokens, "bytes": 0,
                    "sequences": len(out)}, iteration)
            if isinstance(out, dict):  # a chunk: finished rows, and maybe a paused tail
                pieces[i].append(out["done"])
                if len(out["cut"]):
                    migrated += self._handle_tail(i, worker, fut.key, out, weights, specs,
                                                  seed, iteration)
            else:
                pieces[i].append(out)
            if not self.pending[i]:
                trainables.append(self._score(pieces[i], specs, iteration, i))
            released += self._release_if_idle(worker, iteration)
        ended = time.time()
        self.pc.sync_events()
        ledger = self.pc.ledger
        scale_record |= {"actual_s": ended - started, "actual_worker_s":
                         ledger.worker_seconds("gen", until=ended)
                         - ledger.worker_seconds("gen", until=started)}
        self.log(iteration, **scale_record)
        for worker in list(self.load):  # generation is over: the update is the idle gap
            released += self._release_if_idle(worker, iteration)
        self.log_queue_targets(iteration)
        facts = {"gen_workers": len(workers), "migrated_sequences": migrated,
                 "released_during_generation": len(released),
                 "generation_s": time.time() - started,
                 "predicted_generation_s": decision.predicted_seconds}
        return plan, trainables, facts

    def load_of(self, rows: pa.Table, cut: pa.Table | None = None) -> WorkerProgress:
        """Predicted work of a busy worker: every sequence unfinished, remaining tokens
        from the predictor (minus what a cut sequence already generated)."""
        per_seq = rows if cut is None else cut
        n = self.cfg.n_samples if cut is None else 1
        pids = per_seq.column("prompt_id").to_pylist()
        plen = [len(p) for p in per_seq.column("prompt_ids").to_pylist()]
        done = [0] * len(pids) if cut is None else [
            len(p) for p in cut.column("partial_ids").to_pylist()]
        seqs = [(f"{p}#{s}", L + d, max(1.0, self.pred_max[p] - d))
                for p, L, d in zip(pids, plen, done) for s in range(n)]
        return WorkerProgress(len(seqs), 0, [x[0] for x in seqs], [x[1] for x in seqs],
                              [x[2] for x in seqs], busy=True)

    def _submit(self, shard: int, worker: str, load: WorkerProgress, fn, *args, key: str,
                work=None):
        """Submit a generation task to ``worker``, declaring its predicted ``work``
        (default: the remaining tokens of the sequences in ``load``)."""
        work = work or (load.remaining_tokens, load.remaining_tokens, load.current_lengths)
        worker, address = self._placed(worker, key)
        with generation_work(*work):
            fut = self.pc.client.submit(fn, *args, key=key, workers=[address],
                                        resources={"GEN": 1}, allow_other_workers=False,
                                        pure=False)
        self.where[fut.key] = (shard, worker)
        self.pending.setdefault(shard, set()).add(fut.key)
        self.load[worker] = load
        self.ac.add(fut)

    def _placed(self, worker: str, key: str) -> tuple[str, str]:
        """``worker`` and its address, waited for while it starts or restarts; a worker that
        has left the pool (released by the queue's sizing, or lost for good) is replaced:
        by an idle worker of the pool, else by a new one, else by the least loaded."""
        try:
            return worker, self.pc.address_of(worker)
        except KeyError:
            self.load.pop(worker, None)
        members = self.pc.worker_names("gen")
        idle = [w for w in members if w in self.load and not self.load[w].busy]
        if idle:
            other = idle[0]
        elif len(members) < self.cfg.gen_workers:
            other = self.pc.grow("gen", 1)[0]
        else:
            other = min(members, key=lambda w: sum(self.load[w].remaining_tokens)
                        if w in self.load else 0.0)
        self.load.setdefault(other, WorkerProgress(0, 0, busy=False))
        self.log(self.iteration, pool="gen", kind="replace", worker=worker, by=other, key=key,
                 reason=f"worker {worker} left the pool before {key} reached it")
        return other, self.pc.address_of(other)

    def _handle_tail(self, shard: int, worker: str, key: str, out: dict, weights, specs,
                     seed: int, iteration: int) -> int:
        """Resume a paused tail where it is, or move it: ``ScalingPolicy.migrate`` decides."""
        cut: pa.Table = out["cut"]
        n_done = len(out["done"])
        partial = cut.column("partial_ids").to_pylist()
        ids = [seq_id(p, s) for p, s in zip(cut.column("prompt_id").to_pylist(),
                                             cut.column("sample_idx").to_pylist())]
        cur = [len(p) + len(g) for p, g in zip(cut.column("prompt_ids").to_pylist(), partial)]
        rem = self.scaling.remaining([self.pred_max[seq.rsplit("#", 1)[0]] for seq in ids],
                                    [len(g) for g in partial], self.cfg.max_new_tokens)
        self.load[worker] = WorkerProgress(n_done + len(ids), n_done, ids, cur, rem, busy=False)
        moves = [m for m in self.scaling.migrate(self.load, kv_transfer=self.kv_moves)
                 if m.source == worker]
        if not moves:
            self._submit(shard, worker, self.load_of(cut, cut), resume_task, key,
                         weights, specs.gen, key=task_key("resume", iteration, shard))
            return 0
        row_of = {seq: r for r, seq in enumerate(ids)}  # a cut row is its tail's position
        plans = []
        for move in moves:
            rows = [row_of[s] for s in move.seq_ids]
            part = cut.take(pa.array(rows, pa.int64()))
            context = int(sum(cur[r] for r in rows))
            choice = self.scaling.kv_path(context)
            why = move.reason
            if not self.kv_moves:
                choice = replace(choice, path="recompute")
                why += f"; backend {self.cfg.backend} keeps no exportable KV cache: recompute"
            plans.append((move, rows, part, context, choice, why))
        self.load[worker] = WorkerProgress(0, 0, busy=False)  # its whole tail leaves
        client, source = self.pc.client, self.pc.address_of(worker)
        sent = None
        if any(choice.path == "transfer" for *_, choice, _ in plans):
            sent = client.submit(export_tail_task, key, source, workers=[source], pure=False,
                                 allow_other_workers=True,  # a lost source: TailLost
                                 key=task_key("export", iteration, shard))
            self.exports.setdefault(worker, []).append(sent)
        else:
            client.submit(drop_task, key, workers=[source], pure=False).result()
        for j, (move, rows, part, context, choice, why) in enumerate(plans):
            landing = self._move(TailMove(iteration, shard, j, worker, move.target, rows, part,
                                          len(ids), weights, specs, seed), choice.path, sent)
            self.moving[landing] = {
                "pool": "gen", "kind": "migrate", "source": worker, "target": move.target,
                "sequences": len(rows), "context_tokens": context,
                "path": choice.path, "landed_by": choice.path, "reason": why,
                "planned_kv": move.kv,
                "predicted_stay_s": move.stay_seconds, "predicted_move_s": move.move_seconds,
                "predicted_transfer_s": choice.transfer_s,
                "predicted_recompute_s": choice.recompute_s, "predicted_s": choice.predicted_s}
        return sum(len(m.seq_ids) for m in moves)

    def _move(self, move: TailMove, path: str, sent, tag: str = "") -> str:
        """Continue ``move.part`` of a cut tail on ``move.target``: its exported KV
        (``sent``, cut to ``move.rows`` on the source when the tail is split; ``path``
        "transfer") or its prefix recomputed there, then decoded to the end. Returns the key
        of the future that says the move landed; ``tag`` marks the keys of a move landed
        again."""
        load = self.load_of(move.part, move.part)
        gen = move.specs.gen
        continued = move.key("continue", tag)
        if not self.kv_moves:  # the continuation recomputes the prefix itself
            self._submit(move.shard, move.target, load, continue_task, move.part,
                         move.weights, gen, move.seed, key=continued)
            return continued
        client, at = self.pc.client, [self.pc.address_of(move.target)]
        paused = move.key("moved", tag)  # the tail's name there
        if path == "transfer":
            tail = sent if move.rows == list(range(move.n_tail)) else client.submit(
                take_tail_task, sent, move.rows, workers=[self.pc.address_of(move.source)],
                allow_other_workers=True, pure=False, key=move.key("take"))
            adopt = (adopt_tails_task, [tail], paused, move.weights, gen)
        else:
            adopt = (adopt_tails_task, [], paused, move.weights, gen, (), move.part, move.seed)
        adopted = client.submit(*adopt, workers=at, resources={"GEN": 1},
                                allow_other_workers=False, pure=False,
                                key=move.key("adopt", tag))
        self.ac.add(adopted)
        self._submit(move.shard, move.target, load, resume_adopted_task, adopted, move.weights,
                     gen, key=continued)
        if path == "transfer":  # how to land it again if its KV is lost
            self.lost[adopted.key] = self.lost[continued] = move
        return adopted.key

    def _reland_lost(self, fut) -> bool:
        """Whether ``fut`` is the adoption or continuation of a KV move whose export was
        lost (its source died before the target fetched the KV: the export, loosely pinned,
        ran again elsewhere and found no paused decoding, ``TailLost``). The first of the
        two to arrive lands the move again, its tail recomputed on the target from the cut
        rows the driver holds; the other, errored too, is dropped."""
        if fut.key not in self.lost or not isinstance(fut.exception(), TailLost):
            return False
        move = self.lost.pop(fut.key)
        if move is None:  # its twin already landed the move again
            return True
        adopted, continued = move.key("adopt"), move.key("continue")
        self.lost[continued if fut.key == adopted else adopted] = None
        self.where.pop(continued, None)
        self.pending[move.shard].discard(continued)
        record = self.moving.pop(adopted) | {"landed_by": "recompute"}
        self.moving[self._move(move, "recompute", None, tag="relanded")] = record
        return True

    def _landed(self, key: str, facts: dict, iteration: int) -> list[str]:
        """A move's context is on its target: log it with its actual seconds, feed them to
        the policy, let go of the source's export once none is in flight (then the source
        may be released)."""
        record = self.moving.pop(key)
        path = record["landed_by"]
        actual = move_actual_s(path, facts)
        tokens = record["context_tokens"]
        # a continuation's own prefill reaches the throughput model with its rollouts
        self.scaling.observe_move(path, tokens, facts["bytes"], actual,
                                 learn_prefill=stage_of(key) == "adopt")
        self.log(iteration, **record, actual_s=actual, bytes=facts["bytes"],
                 landed_sequences=facts["sequences"])
        source = record["source"]
        if any(r["source"] == source and r["landed_by"] == "transfer"
               for r in self.moving.values()):
            return []
        self.exports.pop(source, None)
        return self._release_if_idle(source, iteration) if source in self.load else []

    def _score(self, pieces: list[Generated], specs, iteration: int, shard: int):
        client = self.pc.client
        # on the trainer, so that generation workers are free to be released
        scored = client.submit(reward_task, Generated.concat(pieces),
                               specs.reward, key=task_key("reward", iteration, shard),
                               resources={"TRAIN": 1})
        return client.submit(advantage_task, scored, self.cfg.algorithm, self.cfg.n_samples,
                             self.cfg.turn_credit,
                             key=task_key("advantage", iteration, shard),
                             resources={"TRAIN": 1})

    def _release_if_idle(self, worker: str, iteration: int) -> list[str]:
        """Retire ``worker`` if it has nothing to do and would idle past the keep-alive:
        until the busiest worker finishes, then through the update. With the queue sizing
        the pool, a worker idle once no other is busy is the drained queue's to release."""
        if (self.load[worker].busy or worker in self.exports
                or worker in {w for _, w in self.where.values()}):
            return []
        busy = [p for p in self.load.values() if p.busy]
        if self.queue_sizing and not busy:
            return []
        gap = self.scaling.idle_gap_s(max((self.scaling.throughput.predict_worker_seconds(
            np.asarray(p.remaining_tokens), 0) for p in busy), default=0.0))
        if self.scaling.keeps_alive(gap):
            return []
        retired = self.pc.retire([worker])
        for name in retired:
            self.load.pop(name, None)
            self.log(iteration, pool="gen", kind="release", worker=name,
                     reason=f"idle gap {gap:.2f} s >= keep-alive "
                            f"{self.scaling.keep_alive_s():.2f} s")
        return retired

    def after_update(self, update_seconds: float,
                     shards: list[GenerationStats]) -> IterationTimings:
        """Write the queue's target changes so far; returns what this iteration measured
        (``shards``: each shard's generation statistics) for the driver to feed the policy
        (``bookkeeping.observe_iteration``)."""
        self.log_queue_targets(self.iteration)
        return IterationTimings(update_seconds, shards, self.pc.ledger.cold_starts("gen"))
