"""What the loop measures and records around an iteration (``modes.ModeRunner.step``).

``observe_iteration`` is where every driver feeds the scheduling
policy what an iteration measured, once per iteration; ``account`` takes in the cluster's
events and returns the iteration's worker-seconds per pool and where they went
(``pool_time.py``: busy, waiting, idle, the bound); ``say_reward_errors`` says the
first reward failures in one line; ``write_ledger`` writes ``ledger.json`` when the run ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pyarrow as pa

from rlhfless.schedulers.ledger import CostLedger
from rlhfless.schedulers.scaling_policy import IterationTimings, ScalingPolicy

from ..cluster.pools import PoolCluster
from ..durable.runs import RunDir
from .pool_time import pool_time


def observe_iteration(scaling: ScalingPolicy, table: pa.Table,
                      timings: IterationTimings | None) -> dict:
    """Feed the scheduling policy what an iteration measured: the response lengths of its
    rows ``table`` (and their ``env_seconds`` where episodes ran, multi-turn or agents) and,
    with an elastic pool, its ``timings`` (``ElasticGeneration.after_update``). The one place
    the driver (``ModeRunner``) calls, once per iteration; returns the
    predictor's error on the lengths (predicted before it saw them) as ``len_pred_*``
    (``len_pred_*_env``: on the seconds outside the model)."""
    ids = table.column("prompt_id").to_pylist()
    lengths = [len(r) for r in table.column("response_ids").to_pylist()]
    env = (table.column("env_seconds").to_numpy()
           if "env_seconds" in table.column_names else None)
    error = scaling.observe_iteration(ids, lengths, timings, env_seconds=env)
    return {f"len_pred_{k}": v for k, v in error.items()}


def account(pc: PoolCluster, ledger: CostLedger, iteration: int, t0: float,
            tasks: list[dict], env_wait_s: float = 0.0) -> dict:
    """The cluster's events into the ledger; this iteration's worker-seconds per pool and,
    from the task-stream records ``tasks`` (``trace.TaskStream``) and the engines' seconds
    waiting on environments ``env_wait_s``, their busy, waiting and idle parts and the
    iteration's bound (``pool_time``)."""
    pc.sync_events()
    t1 = time.time()
    ledger.mark("iteration", iteration, t0, t1)
    return worker_seconds(ledger, t0, t1) | pool_time(tasks, ledger.records(until=t1), t0, t1,
                                                      env_wait_s)


def bill_env_wait(record: dict, prices: dict[str, float]) -> dict:
    """The generation worker-seconds of an iteration in which engines decoded nothing,
    waiting on environments or agents (``env_wait_seconds``, summed over shards: each shard
    holds one worker), billed apart: their cost and their share of ``gen_worker_s``."""
    waited = record.get("env_wait_seconds")
    if not waited:
        return {}
    billed = record.get("gen_worker_s") or 0.0
    return {"env_wait_worker_s": waited, "env_wait_cost": waited * prices["gen"],
            "env_wait_share": waited / billed if billed > 0 else None}


def write_ledger(run: RunDir, ledger: CostLedger, before_resume: dict) -> None:
    run.write_json("ledger.json", {"prices": ledger.prices, "totals": ledger.totals(),
                                   "by_iteration": ledger.by_iteration(),
                                   "records": ledger.records(),
                                   "before_resume": before_resume})


def say_reward_errors(log: Callable[[str], None], iteration: int, table: pa.Table,
                      fallback: float) -> bool:
    """Say the first iteration with failed reward calls, in one line; True if it did."""
    errors = table.column("reward_error").drop_null()
    if not len(errors):
        return False
    log(f"iteration {iteration}: {len(errors)} of {len(table)} samples got reward_fallback = "
        f"{fallback:g} (first: {errors[0]}); every iteration's count is reward_errors in "
        "metrics.jsonl, and this is said once")
    return True


def worker_seconds(ledger: CostLedger, t0: float, t1: float) -> dict:
    """Worker-seconds billed per pool between ``t0`` and ``t1`` (so far in the run)."""
    out = {}
    for pool in ledger.prices:
        out[f"{pool}_worker_s"] = (ledger.worker_seconds(pool, until=t1)
                                   - ledger.worker_seconds(pool, until=t0))
    return out
