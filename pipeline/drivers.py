"""How one iteration runs, and what the loop records about it.

``run_step`` runs iteration ``i`` with the driver the configuration asks for: the static
policy's one graph (``run_iteration``), the elastic policy's generation decided as it runs
then the update (``run_elastic_iteration``), or the async / replay modes' ``ModeRunner``.
``evaluate`` measures held-out accuracy; ``account`` takes in the cluster's events and
returns the iteration's ledger figures and the predictor's error; ``write_ledger`` writes
``ledger.json`` when the run ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa
from distributed import get_task_stream

from rlhfless.ops.gen_stats import Generated
from rlhfless.ops.publish import WeightsRef
from rlhfless.schedulers.ledger import CostLedger
from rlhfless.schedulers.policy import ElasticPolicy

from .cluster import PoolCluster
from .config import Config
from .elastic import ElasticGeneration
from .graph import iteration_graph, rollout_graph
from .metrics import iteration_record
from .modes import ModeRunner
from .runs import RunDir
from .sampler import PromptSampler
from .specs import Specs
from .task_keys import task_key
from .trainer_tasks import publish_task, update_task


def run_step(cfg: Config, runner: ModeRunner | None, eg: ElasticGeneration,
             sampler: PromptSampler, weights: WeightsRef, iteration: int,
             specs: Specs) -> tuple[dict, pa.Table, WeightsRef]:
    """Iteration ``iteration`` by the configuration's driver: (record, rollouts, weights)."""
    if runner is not None:  # async and replay modes (modes.py)
        return runner.step(iteration, weights)
    if cfg.policy == "elastic":
        return run_elastic_iteration(eg, sampler.next_batch(), weights, iteration, specs, cfg)
    return run_iteration(eg.pc, sampler.next_batch(), weights, iteration, specs, cfg,
                         policy=eg.policy)


def evaluate(pc: PoolCluster, heldout: pa.Table, weights: WeightsRef, specs: Specs,
             cfg: Config, policy: ElasticPolicy | None = None) -> dict:
    """Held-out accuracy of greedy decoding with ``weights`` (``policy``: predicts the
    work its generate tasks declare)."""
    if not pc.worker_names("gen"):  # the elastic policy may have released every one
        pc.grow("gen", 1)
    _, _, scored = rollout_graph(heldout, weights, weights.version, cfg.gen_workers, specs.eval,
                              specs.reward, seed=cfg.seed, min_prefix=cfg.min_prefix,
                              tag="eval", policy=policy)
    table = Generated.concat(pc.client.compute(scored, optimize_graph=False, sync=True)).table
    lengths = [len(r) for r in table.column("response_ids").to_pylist()]
    return {"policy_version": weights.version,
            "heldout_accuracy": float(np.mean(table.column("reward").to_numpy())),
            "heldout_response_len_mean": float(np.mean(lengths)), "heldout_n": len(table)}


def on_policy_record(iteration: int, weights: WeightsRef, started: float, plan, trainables: list,
            update: dict, stream: list[dict]) -> tuple[dict, pa.Table]:
    record, table = iteration_record(iteration, weights.version, started, plan, trainables,
                                     update, stream)
    versions = set(table.column("policy_version").to_pylist())
    if versions != {weights.version}:  # synchronous mode: on-policy, by construction
        raise RuntimeError(f"iteration {iteration}: samples of versions {versions}, "
                           f"expected only v{weights.version}")
    return record, table


def run_iteration(pc: PoolCluster, batch: pa.Table, weights: WeightsRef, iteration: int,
                  specs: Specs, cfg: Config,
                  policy: ElasticPolicy | None = None) -> tuple[dict, pa.Table, WeightsRef]:
    """A static-policy iteration: the whole iteration is one graph on the fixed pools."""
    # the batch travels in the graph, not scattered: a worker's death must not lose it
    graph = iteration_graph(batch, weights, iteration, cfg.gen_workers,
                            specs.gen, specs.reward, specs.train, algorithm=cfg.algorithm,
                            seed=cfg.seed, min_prefix=cfg.min_prefix, policy=policy)
    started = time.time()
    with get_task_stream(pc.client) as stream:
        plan, *rest = pc.client.compute(graph.outputs(), optimize_graph=False, sync=True)
    *trainables, update, new_weights = rest
    record, table = on_policy_record(iteration, weights, started, plan, trainables, update,
                                     stream.data)
    return record, table, new_weights


def run_elastic_iteration(eg: ElasticGeneration, batch: pa.Table, weights: WeightsRef,
                          iteration: int, specs: Specs,
                          cfg: Config) -> tuple[dict, pa.Table, WeightsRef]:
    """An elastic-policy iteration: generation decided as it runs, then the update."""
    client = eg.pc.client
    started = time.time()
    with get_task_stream(client) as stream:
        plan, trainable_futures, facts = eg.run_generation(
            batch, weights, iteration, specs, cfg.seed)
        metrics = client.submit(update_task, trainable_futures, weights, specs.train,
                                key=task_key("update", iteration), resources={"TRAIN": 1})
        published = client.submit(publish_task, metrics, specs.train, weights.version + 1,
                                   key=task_key("publish", iteration), resources={"TRAIN": 1})
        trainables, update, new_weights = client.gather(
            [trainable_futures, metrics, published])
    eg.after_update(update["update_seconds"], [t.stats for t in trainables])
    record, table = on_policy_record(iteration, weights, started, plan, trainables, update,
                                     stream.data)
    return record | facts, table, new_weights


def observe_lengths(policy: ElasticPolicy, table: pa.Table) -> dict:
    """Log the predictor's error on this batch (predicted before it saw it), then learn."""
    ids = table.column("prompt_id").to_pylist()
    lengths = [len(r) for r in table.column("response_ids").to_pylist()]
    return {f"len_pred_{k}": v for k, v in policy.observe_lengths(ids, lengths).items()}


def account(pc: PoolCluster, ledger: CostLedger, policy: ElasticPolicy, iteration: int,
            t0: float, table: pa.Table) -> dict:
    """The cluster's events into the ledger; this iteration's worker-seconds per pool and
    the length predictor's error on its rollouts (then the predictor learns them)."""
    pc.sync_events()
    ledger.mark("iteration", iteration, t0, time.time())
    return observe_lengths(policy, table) | worker_seconds(ledger, t0, time.time())


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
