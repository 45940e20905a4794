"""The generation tail, live: leave it, move it (recompute or KV transfer), or reconfigure.

``run_tail`` generates one batch of shards, one shard per generation worker, under a tail
``mode``:

- ``static``: every worker decodes its shard to the end; the pool is billed to the end;
- ``recompute``: each shard pauses at completion fraction ``tau``; the tails are
  consolidated onto one worker (the one with the most sequences left) whose context is
  recomputed there (RLHFless cut-and-migrate as the runtime did it), the others released;
- ``kv``: as ``recompute``, each move's context sent as KV or recomputed, whichever
  ``tail_cost.choose_kv_path`` predicts faster from this run's own timings;
- ``split``: each shard runs until ``tau`` or until the first worker reaches it (a Dask
  event pauses the others); ``tail_split.plan_split`` then sheds sequences from the worker
  predicted to finish last to those predicted to finish first (KV or recompute by cost),
  and every worker decodes what it holds: the pool finishes together, none is released;
- ``reconfig``: PAT on CPU. When the first worker reaches ``tau`` (the others paused, as
  in ``split``) ``tail_cost.plan_reconfig`` compares finishing in place with one worker
  decoding every tail with all the pool's threads (from the decode step profile measured
  at start), the move's cost included; if it pays, the tails are consolidated (KV or
  recompute by cost), the target's torch threads raised and the others released;
  otherwise every tail resumes where it is.

Every move is a record (predicted and actual seconds of the chosen path, bytes, tokens),
and each actual feeds the transfer and prefill models for the next decision. Predicted
remaining tokens come from ``predict_len`` (prompt tokens -> response tokens).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pyarrow as pa
from distributed import Event, as_completed, wait

from rlhfless.ops.engine.engine_types import WeightsRef
from rlhfless.ops.engine.gen_stats import Generated
from rlhfless.pipeline.cluster.pools import PoolCluster
from rlhfless.pipeline.task_keys import task_key
from rlhfless.pipeline.tasks.rollout import GenSpec, generate_chunk_task, resume_task
from rlhfless.pipeline.tasks.tail import (
    TailLost,
    adopt_tails_task,
    export_tail_task,
    move_actual_s,
    set_threads_task,
    split_tail_task,
)
from rlhfless.schedulers.tail_cost import KvChoice, KvCosts, StepProfile, plan_reconfig
from rlhfless.schedulers.tail_split import plan_split

MODES = ("static", "recompute", "kv", "split", "reconfig")
SEED = 11  # the run seed of every draw of a tail bench batch


@dataclass
class TailModels:
    """What the tail decisions learn from the run (fitted online) and measured at start."""

    kv: KvCosts  # transfer vs recompute, and what each move taught it
    profile: StepProfile | None = None
    moves: list[dict] = field(default_factory=list)


def _pairs(table: pa.Table) -> list[tuple[str, int]]:
    return list(zip(table.column("prompt_id").to_pylist(), table.column("sample_idx").to_pylist()))


def run_tail(pc: PoolCluster, names: list[str], shards: list[pa.Table], spec: GenSpec,
             weights: WeightsRef, mode: str, tau: float, models: TailModels,
             predict_len: Callable[[int], float], tag: str) -> dict:
    """Generate ``shards`` (one per worker of ``names``) under ``mode``; returns the
    rollouts, the generation seconds, the pool's worker-seconds and core-seconds, and the
    decisions. Released workers are retired from ``pc``."""
    if mode not in MODES:
        raise ValueError(f"run_tail: mode {mode!r}; allowed: {', '.join(MODES)}")
    c = pc.client
    addr = {n: pc.address_of(n) for n in names}
    pc.sync_events()
    started = time.time()
    threads = dict.fromkeys(names, pc.pools["gen"].threads)
    widened: dict[str, float] = {}  # worker -> when its threads were raised
    until = 1.0 if mode == "static" else tau
    pause = f"{tag}-pause" if mode in ("split", "reconfig") else None
    chunks = {n: c.submit(generate_chunk_task, s, weights, spec, SEED, until, f"{tag}-{n}",
                          pause, workers=[addr[n]], pure=False,
                          key=task_key("chunk", 0, i, tag=tag))
              for i, (n, s) in enumerate(zip(names, shards))}
    if pause is not None:  # the first worker at tau pauses the others where they are
        next(as_completed(list(chunks.values())))
        Event(pause, client=c).set()
    wait(list(chunks.values()))
    paused_s = time.time() - started
    if pause is not None:
        Event(pause, client=c).clear()
    outs = {n: f.result() for n, f in chunks.items()}
    done = [o["done"] for o in outs.values()]
    cuts = {n: o["cut"] for n, o in outs.items() if len(o["cut"])}
    decision: dict = {"mode": mode, "tails": {n: len(t) for n, t in cuts.items()},
                      "paused_s": paused_s}
    released = [n for n in names if n not in cuts] if mode not in ("static", "split") else []
    target, moved = None, []
    if mode == "split":
        rest = _split(pc, addr, threads, cuts, weights, spec, tag, models, predict_len, decision)
    elif len(cuts) >= 2 and mode != "static":
        overhead, choices = _move_costs(cuts, models, mode)
        if mode == "reconfig":
            rem = {n: _remaining(cut, predict_len) for n, cut in cuts.items()}
            plan = plan_reconfig(rem, threads, models.profile, overhead)
            decision["reconfig"] = plan.to_record()
            if plan.fire:
                target = plan.target
        else:
            target = max(cuts, key=lambda n: len(cuts[n]))
        if target is not None:
            moved = [n for n in cuts if n != target]
            _consolidate(pc, addr, target, moved, cuts, choices[target], weights, spec, tag,
                         models, decision)
            if mode == "reconfig":
                before = c.submit(set_threads_task, plan.threads, spec.engine,
                                  workers=[addr[target]], pure=False).result()
                widened[target] = time.time()
                threads[target] = plan.threads
                decision["threads"] = {"before": before, "after": plan.threads}
            released += moved
    if mode != "split":
        keys = {target: f"{tag}-merged"} if target else {n: f"{tag}-{n}" for n in cuts}
        rest = [c.submit(resume_task, k, weights, spec, workers=[addr[n]], pure=False)
                for n, k in keys.items()]
    if released:  # while the tail decodes: nothing of theirs is needed any more
        pc.retire(released)
    done += [f.result() for f in rest]
    # the last rollout's end on its worker: a retirement still winding down is not generation
    ended = max(max(t.table.column("gen_end").to_pylist(), default=started) for t in done)
    for n in widened:  # back to the pool's threads for whatever runs next
        c.submit(set_threads_task, pc.pools["gen"].threads, spec.engine,
                 workers=[addr[n]], pure=False).result()
    pc.sync_events()
    worker_s = (pc.ledger.worker_seconds("gen", until=ended)
                - pc.ledger.worker_seconds("gen", until=started))
    extra_core_s = sum((threads[n] - pc.pools["gen"].threads) * (ended - t)
                       for n, t in widened.items())
    table = Generated.concat(done).table
    ends: dict[str, float] = {}  # per worker, its last rollout's end
    for w, e in zip(table.column("worker").to_pylist(), table.column("gen_end").to_pylist()):
        ends[w] = max(ends.get(w, e), e)
    decision["finish_s"] = {w: e - started for w, e in sorted(ends.items())}
    return {"rollouts": table, "generation_s": ended - started, "worker_s": worker_s,
            "core_s": worker_s * pc.pools["gen"].threads + extra_core_s,
            "released": released, "decision": decision}


def _remaining(cut: pa.Table, predict_len: Callable[[int], float]) -> list[float]:
    """Predicted tokens each cut sequence has still to decode (at least one)."""
    return [max(1.0, predict_len(len(p)) - len(g)) for p, g in zip(
        cut.column("prompt_ids").to_pylist(), cut.column("partial_ids").to_pylist())]


def _context(cut: pa.Table) -> list[int]:
    """Context tokens of each cut sequence (prompt + generated so far): what would travel
    as KV, or be prefilled again."""
    return [len(p) + len(g) for p, g in zip(cut.column("prompt_ids").to_pylist(),
                                            cut.column("partial_ids").to_pylist())]


def _split(pc: PoolCluster, addr: dict, threads: dict[str, int], cuts: dict[str, pa.Table],
           weights: WeightsRef, spec: GenSpec, tag: str, models: TailModels,
           predict_len: Callable[[int], float], decision: dict) -> list:
    """``split`` mode after the pause: plan the sheds (``plan_split``), cut them off their
    sources (who resume the rest at once), land each target's tails on it (KV or
    recomputed, by cost) with its own, and resume every worker's batch; returns the
    resumptions' futures."""
    c = pc.client
    plan = plan_split({n: _remaining(t, predict_len) for n, t in cuts.items()},
                      {n: _context(t) for n, t in cuts.items()}, threads, models.profile,
                      lambda tokens: models.kv.choose(tokens).predicted_s)
    decision["split"] = plan.to_record()

    def resume(worker: str, key: str):
        return c.submit(resume_task, key, weights, spec, workers=[addr[worker]], pure=False)

    sends = {m: c.submit(split_tail_task, f"{tag}-{m.source}", list(m.positions),
                         addr[m.source], workers=[addr[m.source]], allow_other_workers=True,
                         pure=False)
             for m in plan.moves}
    wait(list(sends.values()))
    emptied = {m.source for m, f in sends.items()
               if f.status == "finished" and len(m.positions) == len(cuts[m.source])}
    targets = {m.target for m in plan.moves}
    rest = [resume(n, f"{tag}-{n}") for n in cuts if n not in targets | emptied]
    for dst in targets:
        into = [m for m in plan.moves if m.target == dst]
        kinds = {m.source: (models.kv.choose(m.context_tokens), m.context_tokens,
                            len(m.positions)) for m in into}
        moved = {m.source: cuts[m.source].take(list(m.positions)) for m in into}
        facts, lost = land_tails(
            c, addr[dst], {m.source: sends[m] for m in into
                           if kinds[m.source][0].path == "transfer"},
            moved, [s for s, k in kinds.items() if k[0].path == "recompute"],
            f"{tag}-{dst}-in", (f"{tag}-{dst}",) if dst in cuts else (), weights, spec, SEED)
        _learn_moves(models, decision, dst, kinds, facts, lost)
        rest.append(resume(dst, f"{tag}-{dst}-in"))
    return rest


def _move_costs(cuts: dict[str, pa.Table], models: TailModels, mode: str):
    """Per candidate target: the predicted seconds to bring every other tail to it, and
    the path of each of those moves (forced to recompute in ``recompute`` mode)."""
    ctx = {n: sum(_context(t)) for n, t in cuts.items()}
    choices = {}
    for n in cuts:
        choices[n] = {}
        for src in cuts:
            if src != n:
                k = models.kv.choose(ctx[src])
                if mode == "recompute":
                    k = replace(k, path="recompute")
                choices[n][src] = (k, ctx[src])
    overhead = {n: sum(k.predicted_s for k, _ in choices[n].values()) for n in cuts}
    return overhead, choices


def _consolidate(pc: PoolCluster, addr: dict, target: str, sources: list[str],
                 cuts: dict[str, pa.Table], choices: dict, weights: WeightsRef, spec: GenSpec,
                 tag: str, models: TailModels, decision: dict) -> None:
    """Every source's tail to ``target`` (KV worker to worker, or recomputed there), merged
    with the target's own paused tail under ``<tag>-merged``; each move logged and fed back
    into the models."""
    c = pc.client
    sends = {s: c.submit(export_tail_task, f"{tag}-{s}", addr[s], workers=[addr[s]],
                         allow_other_workers=True, pure=False)
             for s in sources if choices[s][0].path == "transfer"}
    redo = [s for s in sources if choices[s][0].path == "recompute"]
    facts, lost = land_tails(c, addr[target], sends, cuts, redo, f"{tag}-merged",
                             (f"{tag}-{target}",), weights, spec, SEED)
    del sends
    _learn_moves(models, decision, target,
                 {s: (*choices[s], len(cuts[s])) for s in sources}, facts, lost)


def _learn_moves(models: TailModels, decision: dict, target: str,
                 moves: dict[str, tuple[KvChoice, int, int]], facts: dict,
                 lost: list[str]) -> None:
    """Each move into ``target`` (source -> its path choice, context tokens, sequences)
    logged with its predicted and actual seconds, the actual fed back into the cost models.
    One adoption carries every move: its actual time is split by path; a source whose KV
    was lost landed by recomputation from its cut rows."""
    for s, (kind, ctx, n) in moves.items():
        path = "recompute" if s in lost else kind.path
        actual = move_actual_s(path, facts)
        tokens = facts["context_tokens" if path == "transfer" else "recompute_tokens"]
        models.kv.observe(path, tokens, facts["bytes"], actual)
        record = {"t": time.time(), "kind": "move", "source": s, "target": target,
                  "sequences": n, "context_tokens": ctx, "path": kind.path,
                  "landed_by": path, "predicted_transfer_s": kind.transfer_s,
                  "predicted_recompute_s": kind.recompute_s,
                  "predicted_s": kind.predicted_s, "actual_s": actual}
        models.moves.append(record)
        decision.setdefault("moves", []).append(record)


def land_tails(client, target: str, sends: dict, cuts: dict[str, pa.Table], redo: list[str],
               key: str, local: tuple[str, ...], weights: WeightsRef, spec: GenSpec,
               seed: int) -> tuple[dict, list[str]]:
    """Adopt on ``target`` (an address) the tails exported by ``sends`` (source -> future of
    ``export_tail_task``, loosely pinned to the source) and those of ``redo`` recomputed
    from their cut rows ``cuts`` (source -> cut; their draws keyed by the run ``seed``),
    with the target's own paused ``local``, as one decoding paused under ``key``. A source
    that died before the target fetched its KV loses nothing: Dask reruns its export
    elsewhere, which finds no paused decoding (``TailLost``), and its tail is recomputed
    from its cut rows, which the driver holds.
    Returns the adoption's facts and the sources whose KV was lost."""
    def adopt(sent: dict, again: list[str]) -> dict:
        rows = [cuts[s] for s in again]
        return client.submit(adopt_tails_task, list(sent.values()), key, weights, spec,
                             local=local, recompute=pa.concat_tables(rows) if rows else None,
                             seed=seed,
                             workers=[target], pure=False).result()

    try:
        return adopt(sends, redo), []
    except TailLost:
        wait(list(sends.values()))
        lost = [s for s, f in sends.items() if f.status == "error"]
        if not lost:
            raise
        kept = {s: f for s, f in sends.items() if s not in lost}
        return adopt(kept, redo + lost), lost
