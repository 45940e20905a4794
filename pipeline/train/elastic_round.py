"""One iteration's generation under the elastic policy: the controller's per-call state.

``ElasticGeneration.run_generation`` (``elastic.py``) plans the pool and the shards, then
hands them to an ``ElasticRound``, which lives for that call only: it submits each shard as
a chunk that pauses at ``tau``, and as futures complete it resumes or moves each paused tail
(``ScalingPolicy.migrate``: where; ``ScalingPolicy.kv_path``: with its KV cache or
recomputed), lands the moves (a lost export lands again, recomputed), scores each shard as
soon as it is whole, replaces a worker that has left the pool, and releases a worker the
policy says to (``ScalingPolicy.release_idle``). Where the engine can split or consolidate
tails, the tails are instead decided for the whole pool at once (``tail_actions.py``, which
this class mixes in). The state it keeps (each worker's
predicted load, the futures in flight and where, the moves under way, the exports) is
never carried into the next iteration.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa
from distributed import as_completed

from rlhfless.ops.engine.engine_types import WeightsRef
from rlhfless.ops.engine.gen_stats import Generated
from rlhfless.schedulers.dask.plugin import generation_work
from rlhfless.schedulers.migration import WorkerProgress

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
from .generation import Generation
from .tail_actions import TailActions


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


class ElasticRound(TailActions):
    """One call's generation: see the module docstring."""

    def __init__(self, controller: Generation, iteration: int, workers: list[str],
                 pred_max: dict[str, float]) -> None:
        """``controller``: the ``ElasticGeneration`` that planned the call (its cluster,
        config, policy, decisions log and whether moves take the KV cache)."""
        self.pc, self.cfg, self.scaling = controller.pc, controller.cfg, controller.scaling
        self.kv_moves, self.queue_sizing = controller.kv_moves, controller.queue_sizing
        self.log, self.iteration, self.pred_max = controller.log, iteration, pred_max
        self.load = {w: WorkerProgress(0, 0, busy=False) for w in workers}
        self.pending: dict[int, set] = {}
        self.where: dict[str, tuple[int, str]] = {}  # future key -> (shard, worker)
        self.moving: dict[str, dict] = {}  # key of a move's landing future -> its record
        self.exports: dict[str, list] = {}  # source -> futures of its exported tails
        self.lost: dict[str, TailMove | None] = {}  # a KV move's adopt/continue key -> it
        self.ac = as_completed()
        # the pool's tails decided together (``tail_actions.py``) where the engine can split
        # or consolidate them and the run has measured its step profile
        self.tail_actions, self.force = controller.tail_actions, controller.force_tail
        self.releases = controller.reconfig_releases
        self.lent: set[str] = set()  # held by a reconfiguration's target until it ends
        self.clock_scale = controller.clock_scale  # wall seconds per engine second
        self.joint = (len(workers) > 1 and self.scaling.step_profile is not None
                      and bool({"split", "reconfig"} & self.tail_actions))
        self.pause = f"tail-pause-{uuid.uuid4().hex}" if self.joint else None
        self.paused_pool = False  # the pause is set: every chunk stops at its next step
        self.chunks: set[str] = set()  # keys of the chunks not back yet
        self.held: dict[int, tuple] = {}  # shard -> (worker, chunk key, chunk) to decide
        self.adopting: dict[str, dict] = {}  # adoption key -> its split/reconfig record
        self.mixed: dict[str, set[int]] = {}  # key of a decoding -> the shards it holds
        self.decision = None  # (record, keys of its tails' tasks, when) until they finish
        self.shard_prompts: dict[int, pa.Array] = {}

    def run(self, shards: list[pa.Table], workers: list[str], weights: WeightsRef, specs,
            seed: int) -> tuple[list, int, list[str]]:
        """Generate ``shards`` (one per worker of ``workers``) to the end, scoring each as it
        completes; returns one future of a trainable table per shard, the sequences moved,
        and the workers released meanwhile."""
        iteration = self.iteration
        pieces: dict[int, list[Generated]] = {}
        for i, (shard, worker) in enumerate(zip(shards, workers)):
            if len(shard) == 0:
                continue
            key = task_key("generate", iteration, i)
            work = self.scaling.predict_work(shard.column("prompt_id").to_pylist(), [
                len(p) for p in shard.column("prompt_ids").to_pylist()], self.cfg.n_samples)
            self._submit(i, worker, self.load_of(shard), generate_chunk_task, shard,
                         weights, specs.gen, seed, self.scaling.knobs.tau, key, self.pause,
                         key=key, work=work)
            pieces[i] = []
            self.chunks.add(key)
            self.shard_prompts[i] = shard.column("prompt_id").combine_chunks()
        trainables, migrated, released = [], 0, []
        for fut in self.ac:
            if fut.status == "error" and self._reland_lost(fut):
                continue
            if fut.key in self.adopting:  # a split's or reconfiguration's tails landed
                released += self._adopted(fut.key, fut.result())
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
            shards = [i]
            if isinstance(out, dict):  # a chunk: finished rows, and maybe a paused tail
                pieces[i].append(out["done"])
                if self.joint:
                    self.chunks.discard(fut.key)
                    self._hold(i, worker, fut.key, out)
                    if not self.chunks:
                        migrated += self._decide(weights, specs, seed)
                elif len(out["cut"]):
                    migrated += self._handle_tail(i, worker, fut.key, out, weights, specs,
                                                  seed, iteration)
            elif fut.key in self.mixed:  # a decoding that held rows of several shards
                shards = self._hand_back(fut.key, out, pieces)
            else:
                pieces[i].append(out)
            self._decision_done(fut.key)
            for s in shards:
                if not self.pending[s]:
                    trainables.append(self._score(pieces[s], specs, iteration, s))
            if worker in self.load:
                released += self._release_if_idle(worker, iteration)
        self._decision_done(None)  # a tail relanded under a new key: log it now
        return trainables, migrated, released

    def release_idle(self) -> list[str]:
        """Generation is over: release each worker the update's gap is not worth keeping."""
        return [name for worker in list(self.load)
                for name in self._release_if_idle(worker, self.iteration)]

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

    def _tail_state(self, worker: str, out: dict) -> tuple[list[str], list[int], list]:
        """``worker`` paused with ``out``'s tail: its load says so; returns the tail's
        sequence ids, context tokens and predicted remaining tokens."""
        cut: pa.Table = out["cut"]
        n_done = len(out["done"])
        partial = cut.column("partial_ids").to_pylist()
        ids = [seq_id(p, s) for p, s in zip(cut.column("prompt_id").to_pylist(),
                                             cut.column("sample_idx").to_pylist())]
        cur = [len(p) + len(g) for p, g in zip(cut.column("prompt_ids").to_pylist(), partial)]
        rem = self.scaling.remaining([self.pred_max[seq.rsplit("#", 1)[0]] for seq in ids],
                                    [len(g) for g in partial], self.cfg.max_new_tokens)
        self.load[worker] = WorkerProgress(n_done + len(ids), n_done, ids, cur, rem, busy=False)
        return ids, cur, list(rem)

    def _handle_tail(self, shard: int, worker: str, key: str, out: dict, weights, specs,
                     seed: int, iteration: int, moves: list | None = None,
                     path: str = "") -> int:
        """Resume a paused tail where it is, or move it: ``moves`` (the pool's decision,
        ``tail_actions.py``; None: ``ScalingPolicy.migrate`` decides now), each by KV or
        recomputed as ``kv_path`` says unless ``path`` forces one ("kv", "recompute")."""
        cut: pa.Table = out["cut"]
        ids, cur, _ = self._tail_state(worker, out)
        if moves is None:
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
            if path:
                choice = replace(choice, path="transfer" if path == "kv" else "recompute")
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
        target, address = self._placed(move.target, continued)  # it may have left the pool
        move, client, at = replace(move, target=target), self.pc.client, [address]
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
        """Retire ``worker`` if it has nothing to do and the policy says so
        (``release_idle``); the decision is the policy's, applied here. With the queue
        sizing the pool, a worker idle once no other is busy is the drained queue's to
        release."""
        if (self.load[worker].busy or len(self.load[worker].seq_ids) or worker in self.exports
                or worker in {w for _, w in self.where.values()}
                or worker in self.lent and self.where):
            return []
        busy = [p for p in self.load.values() if p.busy]
        if self.queue_sizing and not busy:
            return []
        decision = self.scaling.release_idle(busy)
        if not decision.release:
            return []
        retired = self.pc.retire([worker])
        for name in retired:
            self.load.pop(name, None)
            self.log(iteration, pool="gen", kind="release", worker=name,
                     reason=decision.reason)
        return retired

