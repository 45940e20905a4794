"""The generation tail, live: leave it, move it (recompute or KV transfer), or reconfigure.

``run_tail`` generates one batch of shards, one shard per generation worker, under a tail
``mode``:

- ``static``: every worker decodes its shard to the end; the pool is billed to the end;
- ``recompute``: each shard pauses at completion fraction ``tau``; the tails are
  consolidated onto one worker (the one with the most sequences left) whose context is
  recomputed there (RLHFless cut-and-migrate as the runtime did it), the others released;
- ``kv``: as ``recompute``, each move's context sent as KV or recomputed, whichever
  ``tail_cost.choose_kv_path`` predicts faster from this run's own timings;
- ``reconfig``: PAT on CPU. At ``tau`` ``tail_cost.plan_reconfig`` compares finishing in
  place with one worker decoding every tail with all the pool's threads (from the decode
  step profile measured at start), the move's cost included; if it pays, the tails are
  consolidated (KV or recompute by cost), the target's torch threads raised and the
  others released; otherwise every tail resumes where it is.

Every move is a record (predicted and actual seconds of the chosen path, bytes, tokens),
and each actual feeds the transfer and prefill models for the next decision. Predicted
remaining tokens come from ``predict_len`` (prompt tokens -> response tokens).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pyarrow as pa
from distributed import wait

from rlhfless.ops.gen_stats import Generated
from rlhfless.ops.publish import WeightsRef
from rlhfless.schedulers.tail_cost import KvCosts, StepProfile, plan_reconfig

from .cluster import PoolCluster
from .rollout_tasks import GenSpec, generate_chunk_task, resume_task
from .tail_tasks import (
    TailLost,
    adopt_tails_task,
    export_tail_task,
    move_actual_s,
    profile_steps_task,
    set_threads_task,
)
from .task_keys import task_key

MODES = ("static", "recompute", "kv", "reconfig")
SEED = 11  # the run seed of every draw of a tail bench batch


@dataclass
class TailModels:
    """What the tail decisions learn from the run (fitted online) and measured at start."""

    kv: KvCosts  # transfer vs recompute, and what each move taught it
    profile: StepProfile | None = None
    moves: list[dict] = field(default_factory=list)


def measure_profile(pc: PoolCluster, names: list[str], spec: GenSpec, weights: WeightsRef,
                    batches: tuple[int, ...], steps: int = 16, repeats: int = 5) -> StepProfile:
    """The decode step profile that ``reconfig`` decides from, measured on the pool at start
    as each side of the decision runs: the pool's threads on every worker of ``names`` at
    once (staying, they share the machine's memory bandwidth and caches), and all their
    threads on one worker while the others idle (the consolidated tail, the others
    released); ``steps`` and ``repeats`` as ``profile_steps_task``'s."""
    c, threads = pc.client, pc.pools["gen"].threads
    first = pc.address_of(names[0])
    shared = [c.submit(profile_steps_task, spec, weights, batches, (threads,), steps,
                       repeats=repeats, workers=[pc.address_of(n)], pure=False) for n in names]
    stay = shared[0].result()
    wait(shared)
    wide = c.submit(profile_steps_task, spec, weights, batches, (threads * len(names),), steps,
                    repeats=repeats, workers=[first], pure=False).result()
    return StepProfile(stay | wide)


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
    chunks = {n: c.submit(generate_chunk_task, s, weights, spec, SEED, until, f"{tag}-{n}",
                          workers=[addr[n]], pure=False, key=task_key("chunk", 0, i, tag=tag))
              for i, (n, s) in enumerate(zip(names, shards))}
    wait(list(chunks.values()))
    outs = {n: f.result() for n, f in chunks.items()}
    done = [o["done"] for o in outs.values()]
    cuts = {n: o["cut"] for n, o in outs.items() if len(o["cut"])}
    decision: dict = {"mode": mode, "tails": {n: len(t) for n, t in cuts.items()}}
    released = [n for n in names if n not in cuts] if mode != "static" else []
    target, moved = None, []
    if len(cuts) >= 2 and mode != "static":
        overhead, choices = _move_costs(cuts, models, mode)
        if mode == "reconfig":
            rem = {n: [max(1.0, predict_len(len(p)) - len(g)) for p, g in zip(
                cut.column("prompt_ids").to_pylist(), cut.column("partial_ids").to_pylist())]
                for n, cut in cuts.items()}
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
                before = c.submit(set_threads_task, plan.threads, workers=[addr[target]],
                                  pure=False).result()
                widened[target] = time.time()
                threads[target] = plan.threads
                decision["threads"] = {"before": before, "after": plan.threads}
            released += moved
    keys = {target: f"{tag}-merged"} if target else {n: f"{tag}-{n}" for n in cuts}
    rest = [c.submit(resume_task, k, weights, spec, workers=[addr[n]], pure=False)
            for n, k in keys.items()]
    if released:  # while the tail decodes: nothing of theirs is needed any more
        pc.retire(released)
    done += [f.result() for f in rest]
    # the last rollout's end on its worker: a retirement still winding down is not generation
    ended = max(max(t.table.column("gen_end").to_pylist(), default=started) for t in done)
    for n in widened:  # back to the pool's threads for whatever runs next
        c.submit(set_threads_task, pc.pools["gen"].threads, workers=[addr[n]],
                 pure=False).result()
    pc.sync_events()
    worker_s = (pc.ledger.worker_seconds("gen", until=ended)
                - pc.ledger.worker_seconds("gen", until=started))
    extra_core_s = sum((threads[n] - pc.pools["gen"].threads) * (ended - t)
                       for n, t in widened.items())
    table = Generated.concat(done).table
    return {"rollouts": table, "generation_s": ended - started, "worker_s": worker_s,
            "core_s": worker_s * pc.pools["gen"].threads + extra_core_s,
            "released": released, "decision": decision}


def _move_costs(cuts: dict[str, pa.Table], models: TailModels, mode: str):
    """Per candidate target: the predicted seconds to bring every other tail to it, and
    the path of each of those moves (forced to recompute in ``recompute`` mode)."""
    ctx = {n: sum(len(p) + len(g) for p, g in zip(t.column("prompt_ids").to_pylist(),
                                                  t.column("partial_ids").to_pylist()))
           for n, t in cuts.items()}
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
    sends = {s: c.submit(export_tail_task, f"{tag}-{s}", workers=[addr[s]],
                         allow_other_workers=True, pure=False)
             for s in sources if choices[s][0].path == "transfer"}
    redo = [s for s in sources if choices[s][0].path == "recompute"]
    facts, lost = land_tails(c, addr[target], sends, cuts, redo, f"{tag}-merged",
                             (f"{tag}-{target}",), weights, spec, SEED)
    del sends
    for s in sources:  # one adopt carries every move: its actual time is split by path
        kind, ctx = choices[s]
        path = "recompute" if s in lost else kind.path  # lost KV: recomputed from the cut
        actual = move_actual_s(path, facts)
        tokens = facts["context_tokens" if path == "transfer" else "recompute_tokens"]
        models.kv.observe(path, tokens, facts["bytes"], actual)
        record = {"t": time.time(), "kind": "move", "source": s, "target": target,
                  "sequences": len(cuts[s]), "context_tokens": ctx, "path": kind.path,
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
