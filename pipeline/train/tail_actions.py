"""The pool's tails decided together: an ``ElasticRound``'s pause, decision and actions.

With an engine that can split a paused batch or consolidate tails (``tail_actions``), and a
step profile measured by the run (``step_profile.py``), every shard's chunk is submitted
with a Dask ``Event`` as its pause: the first chunk back (at ``tau``, or finished) sets it,
the others stop at their next decode step, and once every chunk is back the policy chooses
for the whole pool (``ScalingPolicy.choose_tail``: stay, move, split or reconfigure, by
predicted finish from the profile, moves' landing included) and the round applies it:

- *stay*: each tail resumes where it paused;
- *move*: each planned move as the round moves tails one by one (``_handle_tail``);
- *split*: each source cuts the sequences it sheds out of its paused batch
  (``split_tail_task``) and resumes the rest; each target adopts them (KV or recomputed,
  by cost) with its own paused tail and decodes them together;
- *reconfig*: one worker adopts every tail (KV or recomputed) with its own and decodes them
  with all the live workers' threads (``resume_wide_task``); the others are released once
  their tails have landed.

A decoding that holds rows of several shards (split, reconfig) is handed back to each shard
by its prompts, so scoring stays per shard. The decision is one ``decisions.jsonl`` line
(``kind = "tail"``: every option's prediction, the action, the predicted and the actual
seconds until the last of its tails finished); each landing is another (``kind =
"tail_move"``: predicted and actual seconds by path), whose actual the cost models learn.
"""

from __future__ import annotations

import time

import pyarrow as pa
import pyarrow.compute as pa_compute
from distributed import Event, wait

from rlhfless.ops.engine.gen_stats import Generated, GenerationStats
from rlhfless.schedulers.migration import WorkerProgress
from rlhfless.schedulers.scaling_policy import Tail
from rlhfless.schedulers.tail_cost import KvChoice

from ..task_keys import task_key
from ..tasks.rollout import drop_task, resume_task
from ..tasks.tail import (
    adopt_tails_task,
    export_tail_task,
    move_actual_s,
    resume_adopted_task,
    resume_wide_task,
    split_tail_task,
)

HELD = "held"  # a shard's pending entry while its tail waits for the pool's decision


class TailActions:
    """The joint tail decision of an ``ElasticRound`` (which this mixes into); see the
    module docstring."""

    def _hold(self, shard: int, worker: str, key: str, out: dict) -> None:
        """A chunk is back: pause the others (first time) and keep its tail, if any, for
        the decision; decide once every chunk is back."""
        if not self.paused_pool:
            Event(self.pause, client=self.pc.client).set()
            self.paused_pool = True
        if len(out["cut"]):
            self._tail_state(worker, out)  # paused with a tail: not idle
            self.held[shard] = (worker, key, out)
            self.pending[shard].add(HELD)

    def _decide(self, weights, specs, seed: int) -> int:
        """Every chunk is back: choose for the pool's tails and apply; returns the
        sequences moved."""
        Event(self.pause, client=self.pc.client).clear()
        held, self.held = self.held, {}
        if not held:
            return 0
        tails = {}
        for worker, _, out in held.values():
            ids, cur, rem = self._tail_state(worker, out)
            tails[worker] = Tail(tuple(ids), tuple(map(float, rem)), tuple(cur))
        threads = dict.fromkeys(self.load, self.pc.pools["gen"].threads)
        choice = self.scaling.choose_tail(self.load, tails, threads, self.tail_actions,
                                          self.kv_moves, self.force)
        before = set(self.where)
        by_worker = {w: (shard, key, out) for shard, (w, key, out) in held.items()}
        moved = 0
        if choice.action == "move":
            plan: dict[str, list] = {}
            for m in choice.moves:
                plan.setdefault(m.source, []).append(m)
            for w, (shard, key, out) in by_worker.items():
                moved += self._handle_tail(shard, w, key, out, weights, specs, seed,
                                           self.iteration, plan.get(w, []), choice.path)
        elif choice.action == "split":
            moved = self._split(by_worker, choice.split.moves, weights, specs, seed)
        elif choice.action == "reconfig":
            moved = self._reconfig(by_worker, tails, choice.reconfig, weights, specs, seed)
        else:
            for w, (shard, key, out) in by_worker.items():
                self._resume(shard, w, key, out, weights, specs)
        for shard in held:
            self.pending[shard].discard(HELD)
        self.decision = ({"pool": "gen", "kind": "tail", **choice.to_record(),
                          "sequences_moved": moved}, set(self.where) - before, time.time())
        return moved

    def _resume(self, shard: int, worker: str, key: str, out: dict, weights, specs) -> None:
        self._submit(shard, worker, self.load_of(out["cut"], out["cut"]), resume_task, key,
                     weights, specs.gen, key=task_key("resume", self.iteration, shard))

    def _split(self, by_worker: dict, sheds, weights, specs, seed: int) -> int:
        """Each source cuts what it sheds and resumes the rest; each target adopts what it
        receives with its own tail."""
        c, at = self.pc.client, self.pc.address_of
        sends = {m: c.submit(split_tail_task, by_worker[m.source][1], list(m.positions),
                             at(m.source), workers=[at(m.source)], allow_other_workers=True,
                             pure=False, key=task_key("split", self.iteration,
                                                      by_worker[m.source][0], j))
                 for j, m in enumerate(sheds)}
        wait(list(sends.values()))
        targets = {m.target for m in sheds}
        for w, (shard, key, out) in by_worker.items():
            shed = sum(len(m.positions) for m in sheds if m.source == w)
            if w not in targets and shed < len(out["cut"]):
                self._resume(shard, w, key, out, weights, specs)
        for dst in targets:
            into = [m for m in sheds if m.target == dst]
            parts = {m.source: (sends[m], by_worker[m.source][2]["cut"].take(
                list(m.positions)), m.context_tokens) for m in into}
            self._land(dst, parts, by_worker, weights, specs, seed, [], "split")
        return sum(len(m.positions) for m in sheds)

    def _reconfig(self, by_worker: dict, tails: dict[str, Tail], plan, weights, specs,
                  seed: int) -> int:
        """Every other tail to ``plan.target`` (exported, or dropped there and its rows
        recomputed), decoded there on ``plan.threads`` threads' width; the sources released
        once landed where the engine gives their threads to the target
        (``reconfig_releases``), else held by it until it ends."""
        c, at = self.pc.client, self.pc.address_of
        parts, paths = {}, {}
        for w, (shard, key, out) in by_worker.items():
            if w == plan.target:
                continue
            context = sum(tails[w].context)
            paths[w] = self._path(context)
            task = (export_tail_task, key, at(w)) if paths[w].path == "transfer" \
                else (drop_task, key)
            sent = c.submit(*task, workers=[at(w)], allow_other_workers=True, pure=False,
                            key=task_key("export", self.iteration, shard))
            parts[w] = (sent, out["cut"], context)
        wait([p[0] for p in parts.values()])
        self._land(plan.target, parts, by_worker, weights, specs, seed, list(parts),
                   "reconfig", plan.threads, paths)
        return sum(len(p[1]) for p in parts.values())

    def _path(self, context_tokens: int) -> KvChoice:
        """How a landing's context reaches its target: the cost model's choice, or the path
        the run forces for every landing."""
        path = self.scaling.kv_path(context_tokens)
        if self.force in ("kv", "recompute"):
            return KvChoice("transfer" if self.force == "kv" else "recompute",
                            path.transfer_s, path.recompute_s)
        return path

    def _land(self, dst: str, parts: dict, by_worker: dict, weights, specs, seed: int,
              release: list[str], action: str, threads: int | None = None,
              paths: dict[str, KvChoice] | None = None) -> None:
        """Adopt on ``dst`` the ``parts`` (source -> its exported future, its cut rows, its
        context tokens), each by KV or recomputed (``paths``, else ``_path``), with
        ``dst``'s own paused tail, and decode them all there; the rows are handed back to
        their shards."""
        c, at = self.pc.client, self.pc.address_of
        paths = paths or {s: self._path(ctx) for s, (_, _, ctx) in parts.items()}
        kv = [parts[s][0] for s in parts if paths[s].path == "transfer"]
        redo = [parts[s][1] for s in parts if paths[s].path == "recompute"]
        own = by_worker.get(dst)
        shards = {by_worker[s][0] for s in parts} | ({own[0]} if own else set())
        shard = own[0] if own else min(shards)
        paused = task_key("adopt", self.iteration, shard, tag=action)
        adopted = c.submit(adopt_tails_task, kv, paused, weights, specs.gen,
                           (own[1],) if own else (), pa.concat_tables(redo) if redo else None,
                           seed, workers=[at(dst)], resources={"GEN": 1},
                           allow_other_workers=False, pure=False, key=paused + "-in")
        self.ac.add(adopted)
        self.adopting[adopted.key] = {
            "pool": "gen", "kind": "tail_move", "action": action, "target": dst,
            "release": release, "moves": {s: {"path": paths[s].path, "sequences":
                                              len(parts[s][1]), "context_tokens": parts[s][2],
                                              "predicted_s": paths[s].predicted_s}
                                          for s in parts}}
        rows = pa.concat_tables([parts[s][1] for s in parts] + ([own[2]["cut"]] if own else []))
        load = self.load_of(rows, rows)
        key = task_key("resume", self.iteration, shard, tag=action)
        if threads is None:
            self._submit(shard, dst, load, resume_adopted_task, adopted, weights, specs.gen,
                         key=key)
        else:
            self._submit(shard, dst, load, resume_wide_task, adopted, weights, specs.gen,
                         threads, key=key)
        for s in shards - {shard}:
            self.pending[s].add(key)
        self.mixed[key] = shards

    def _adopted(self, key: str, facts: dict) -> list[str]:
        """A split's or reconfiguration's landing: each source's actual seconds logged and
        learned (the adoption's time split by path); a reconfiguration's sources released."""
        record = self.adopting.pop(key)
        for move in record["moves"].values():
            actual = move_actual_s(move["path"], facts)
            move["actual_s"] = actual
            self.scaling.observe_move(move["path"], move["context_tokens"], facts["bytes"],
                                      actual)
        self.log(self.iteration, **record, bytes=facts["bytes"])
        released = []
        for source in record["release"]:
            self.load[source] = WorkerProgress(0, 0, busy=False)
            if not self.releases:  # its GPUs decode the target's wider TP until it ends
                self.lent.add(source)
                continue
            for name in self.pc.retire([source]):
                self.load.pop(name, None)
                released.append(name)
                self.log(self.iteration, pool="gen", kind="release", worker=name,
                         reason=f"its tail was consolidated onto {record['target']}")
        return released

    def _hand_back(self, key: str, out: Generated, pieces: dict) -> list[int]:
        """The rows of a decoding that held several shards, each to its shard; returns the
        shards it completed a part of."""
        shards = sorted(self.mixed.pop(key))
        pid = out.table.column("prompt_id")
        for j, s in enumerate(shards):
            rows = out.table.filter(pa_compute.is_in(pid, value_set=self.shard_prompts[s]))
            pieces[s].append(Generated(rows, out.stats if j == 0 else GenerationStats()))
            self.pending[s].discard(key)
        return shards

    def _decision_done(self, key: str | None) -> None:
        """The last tail of the pool's decision finished (``key``; None: generation is
        over): its line, with the actual."""
        if self.decision is None or key is not None and key not in self.decision[1]:
            return
        record, keys, started = self.decision
        keys.discard(key)
        if not keys or key is None:
            self.log(self.iteration, **record,
                     actual_s=(time.time() - started) / self.clock_scale)
            self.decision = None
