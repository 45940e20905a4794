"""Emulated runs: the live runtime over a workload trace, on emulated GPUs.

``run_emulated(cfg, trace, run_dir)`` runs the iterations of ``trace`` with the real runtime
(a ``LocalCluster`` of worker processes through ``PoolCluster``, the elasticity plugin, the
cost ledger, ``ElasticGeneration`` for ``policy = "elastic"``: scaling, length assignment,
cut-and-migrate of the tail, release of idle workers, ``decisions.jsonl``) while generation
and the update are the emulated tasks of ``pipeline/tasks/emulated_backend.py``, timed by the
profile ``cfg.emulate_profile``. Rewards and advantages are the real tasks on the trainer.

Time: an emulated second lasts ``cfg.emulate_time_scale`` wall seconds. The ledger keeps
emulated seconds (``EmulatedClockLedger`` maps the wall clock), so the policy's inputs
(cold starts, update seconds, step timings) and every figure here share one unit. What the
runtime itself costs is measured on the wall clock and also given in emulated seconds: an
iteration's *overhead* is the time during which no emulated task was running (driver
decisions, task dispatch, transfers, scaling waits, rewards and advantages), ``late_wall_s``
how long emulated tasks ran past their emulated duration (their own work, or no CPU in time),
``scaling_wall_s`` the driver's time inside ``grow``/``retire``, ``transfer_wall_s`` the
workers' summed transfers. ``emulated_path_s`` is the emulated work on the iteration's
critical path (the longest shard's generation, its pieces' emulated seconds summed, plus the
update) and ``runtime_s`` the rest of the step: everything the runtime added to it. A
worker's process start is part of its measured cold start (the ledger bills it); the policy
learns the profile's cold start instead (``cold_starts``), so that its decisions are those it
would take on the emulated cluster, not on this machine.

Not emulated here: checkpoints (the trainer holds no state) and held-out evaluation.

With ``policy = "static"`` the pool is ``gen_workers`` from the start, each prompt group
dealt round-robin to a worker, each shard generated whole: the simulator's static policy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import psutil
import pyarrow as pa
from distributed import get_task_stream

from rlhfless.ops.data.prefix_dedup import plan_prefixes
from rlhfless.ops.data.shard import take_shards
from rlhfless.ops.engine.gen_stats import Generated
from rlhfless.ops.engine.seeds import generation_seed
from rlhfless.pipeline.tasks import emulated_backend as emu
from rlhfless.schedulers.ledger import CostLedger
from rlhfless.schedulers.profiles import Profile, get_profile
from rlhfless.schedulers.scaling import round_robin
from rlhfless.schedulers.scaling_policy import ScalingPolicy
from rlhfless.schedulers.sim.sim_policy import PAPER_MECHANISMS, PolicyConfig, SimPolicy
from rlhfless.schedulers.sim.workloads import Batch, Trace

from ..cluster.deploy import LocalDeployment
from ..cluster.pools import Pool, PoolCluster
from ..config import Config
from ..durable.runs import RunDir
from ..report.bookkeeping import observe_iteration
from ..task_keys import EMULATED_STAGES, stage_of, task_key
from ..tasks.scoring import RewardSpec, advantage_task, reward_task
from .elastic import ElasticGeneration
from .graph import submit_update


class EmulatedClockLedger(CostLedger):
    """A ``CostLedger`` fed wall-clock times that keeps emulated ones: ``t`` becomes
    ``origin + (t - origin) / scale``."""

    def __init__(self, prices, scale: float, cold_start_s: float,
                 origin: float | None = None) -> None:
        super().__init__(prices)
        self.scale, self.origin = scale, time.time() if origin is None else origin
        self.cold_start_s = cold_start_s

    def emulated(self, t: float | None) -> float | None:
        return None if t is None else self.origin + (t - self.origin) / self.scale

    def worker_started(self, name, pool, t, cold_start_s=0.0) -> None:
        super().worker_started(name, pool, self.emulated(t), cold_start_s / self.scale)

    def worker_ready(self, name, t) -> None:
        super().worker_ready(name, self.emulated(t))

    def worker_stopped(self, name, t) -> None:
        super().worker_stopped(name, self.emulated(t))

    def mark(self, stage, iteration, t_start, t_end) -> None:
        super().mark(stage, iteration, self.emulated(t_start), self.emulated(t_end))

    def worker_seconds(self, pool=None, until=None) -> float:
        return super().worker_seconds(pool, self.emulated(until))

    def cold_starts(self, pool=None) -> list[float]:
        """The emulated cold start (``cold_start_s``) of each worker that became ready: what
        the policy learns from. The measured ones (``measured_cold_starts``) include this
        machine's process start, runtime overhead reported apart."""
        return [self.cold_start_s for _ in super().cold_starts(pool)]

    def measured_cold_starts(self, pool=None) -> list[float]:
        return super().cold_starts(pool)


# Dask's own diagnostics in an emulated generation worker process, which serve the dashboard,
# not the runtime: no stack sampling for the profiler (every 10 ms by default), the event
# loop's health tick every second (20 ms) and the system monitor every 2 s (0.5 s). At their
# defaults an idle worker process took 2.7 % of a core, 64 of them most of a 2-core machine;
# with these 0.5-0.7 % (README, "Emulated pools").
# (Dotted keys: the nanny merges them shallowly into its whole configuration.)
QUIET_WORKER_CONFIG = {"distributed.worker.profile.enabled": False,
                       "distributed.admin.tick.interval": "1s",
                       "distributed.admin.system-monitor.interval": "2s"}


@dataclass(frozen=True)
class EmulatedDeployment(LocalDeployment):
    """Local worker processes; a generation worker sleeps its emulated cold start (from its
    process start) in a preload, before it registers with the scheduler, and runs Dask's
    diagnostics at ``QUIET_WORKER_CONFIG``."""

    cold_start_wall_s: float = 0.0

    def worker_spec(self, pool: Pool, name: str) -> dict:
        spec = super().worker_spec(pool, name)
        if pool.name == "gen":
            options = spec["options"]
            options["preload"] = [emu.__name__]
            options["config"] = QUIET_WORKER_CONFIG
            options["env"] = {**options["env"],
                              emu.COLD_START_ENV: str(self.cold_start_wall_s)}
        return spec


class TimedPoolCluster(PoolCluster):
    """A ``PoolCluster`` that adds up the wall seconds the driver spends growing and
    retiring workers."""

    scaling_wall_s = 0.0

    def grow(self, pool: str, n: int, wait: bool = True) -> list[str]:
        started = time.time()
        try:
            return super().grow(pool, n, wait)
        finally:
            self.scaling_wall_s += time.time() - started

    def retire(self, names: list[str]) -> list[str]:
        started = time.time()
        try:
            return super().retire(names)
        finally:
            self.scaling_wall_s += time.time() - started


@dataclass(frozen=True)
class EmulatedSpecs:
    gen: emu.EmulatedGenSpec
    reward: RewardSpec
    train: emu.EmulatedTrainSpec


def prompts_table(batch: Batch, seed: int) -> pa.Table:
    """The prompts of a trace batch: distinct random token ids of each prompt's length (no
    two prompts share a prefix), ``answer`` "0" for the parity reward, the group's lengths."""
    rng = np.random.default_rng([seed, batch.iteration])
    ids = [rng.integers(1000, 30000, int(n), dtype=np.int32) for n in batch.prompt_tokens]
    return pa.table({
        "prompt_id": pa.array(batch.prompt_ids.tolist(), pa.string()),
        "prompt_ids": pa.array(ids, pa.list_(pa.int32())),
        "answer": pa.array(["0"] * batch.n_groups, pa.string()),
        "data_source": pa.array(["emulated"] * batch.n_groups, pa.string()),
        emu.LENGTHS: pa.array(batch.lengths.astype(np.int64).tolist(), pa.list_(pa.int64())),
    })


def engine_cap(profile: Profile, trace: Trace) -> int:
    """The engine's live-sequence cap at the trace's first batch's mean context (as the
    simulator takes it)."""
    first = trace.batches[0]
    return profile.batch_cap(float(first.prompt_tokens.mean() + first.lengths.mean()))


def as_live(profile: Profile) -> Profile:
    """``profile`` as the live runtime runs it: a released worker's process exits, so a
    restart is a cold start (``gen_wake_s``), and a moved tail recomputes its prefix (no KV
    transfer path); the simulator takes this one to time the same policy."""
    return profile.replace(gen_wake_s=profile.gen_cold_start_s, kv_link_gbs=0.0)


def simulator_policy(cfg: Config) -> PolicyConfig:
    """The simulator's policy for the live one ``cfg.policy`` runs, with ``cfg``'s knobs."""
    if cfg.policy == "static":  # the whole pool from the start to the end, round-robin
        return PolicyConfig("static", billing="reserved", scaling="static",
                            assignment="round_robin", migration="none", prewarm=False)
    return PAPER_MECHANISMS.replace(  # workers are waited for, the step scored whole
        name="elastic", prewarm=False, score_step=True, tau=cfg.tau,
        lambda_cost=cfg.lambda_cost, ewma_alpha=cfg.ewma_alpha)


def prior_state(cfg: Config, profile: Profile, trace: Trace) -> ScalingPolicy:
    """The policy's starting models: the throughput prior the simulator derives from
    ``as_live(profile)`` (``SimPolicy``), the length predictor with ``cfg.ewma_alpha``."""
    first = trace.batches[0]
    sim = SimPolicy(PolicyConfig(ewma_alpha=cfg.ewma_alpha), profile, cfg.gen_workers,
                    engine_cap(profile, trace), ctx_hint=float(
                        first.prompt_tokens.mean() + 0.5 * first.lengths.mean()),
                    max_response_tokens=trace.max_response_tokens)
    return ScalingPolicy(cfg.scaling_knobs(), sim.scaling.throughput)


def _static_generation(pc: PoolCluster, cfg: Config, batch: pa.Table, weights, iteration: int,
                       specs: EmulatedSpecs, seed: int) -> list:
    plan = plan_prefixes(batch, cfg.n_samples, cfg.min_prefix)
    workers = pc.worker_names("gen")
    pc.wait_for(workers)  # a worker its nanny restarts is back before it gets a shard
    shards = take_shards(plan.prompts, round_robin(np.zeros(len(plan.prompts)), len(workers)))
    out = []
    for i, (shard, worker) in enumerate(zip(shards, workers)):
        if len(shard) == 0:
            continue
        rollouts = pc.client.submit(emu.generate_task, shard, weights, specs.gen,
                                    generation_seed(seed, iteration),
                                    key=task_key("generate", iteration, i), resources={"GEN": 1},
                                    workers=[pc.address_of(worker)], allow_other_workers=False,
                                    pure=False)
        scored = pc.client.submit(reward_task, rollouts, specs.reward,
                                  key=task_key("reward", iteration, i), resources={"TRAIN": 1})
        out.append(pc.client.submit(advantage_task, scored, cfg.algorithm, cfg.n_samples,
                                    cfg.turn_credit,
                                    key=task_key("advantage", iteration, i),
                                    resources={"TRAIN": 1}))
    return out


def _uncovered(stream: list[dict], t0: float, t1: float) -> float:
    """Wall seconds of [t0, t1] during which no emulated task was computing. A span is
    clipped to the window; one that ends up empty (the scheduler shifts a worker's times by
    its estimated clock offset, so a span may start after ``t1`` or stop before ``t0``)
    covers nothing."""
    spans = sorted((max(s["start"], t0), min(s["stop"], t1)) for task in stream
                   if stage_of(task["key"]) in EMULATED_STAGES
                   for s in task["startstops"] if s["action"] == "compute")
    covered, end = 0.0, t0
    for a, b in spans:
        start = max(a, end)  # what an earlier span has not covered yet
        if b > start:
            covered += b - start
            end = b
    return (t1 - t0) - covered


def _transfer_s(stream: list[dict]) -> float:
    return float(sum(s["stop"] - s["start"] for task in stream for s in task["startstops"]
                     if s["action"] == "transfer"))


def worker_memory() -> dict:
    """RSS and USS (unique pages) of this process's children, GiB, and their count."""
    kids = psutil.Process().children(recursive=True)
    rss = uss = 0
    for kid in kids:
        try:
            info = kid.memory_full_info()
        except psutil.Error:  # exited meanwhile
            continue
        rss, uss = rss + info.rss, uss + info.uss
    return {"processes": len(kids), "rss_gib": rss / 2**30, "uss_gib": uss / 2**30}


def run_emulated(cfg: Config, trace: Trace, run_dir: str, train_gpus: int = 1) -> dict:
    """Run ``trace`` on emulated GPUs (see the module docstring); returns per-iteration
    records, run totals (emulated seconds) and the peak memory of the worker processes."""
    profile, scale = get_profile(cfg.emulate_profile), cfg.emulate_time_scale
    run = RunDir(cfg.run_dir if run_dir is None else run_dir)
    specs = EmulatedSpecs(
        emu.EmulatedGenSpec(profile, cfg.n_samples, scale, engine_cap(profile, trace),
                            cfg.max_new_tokens),
        RewardSpec({"emulated": "exact"}, "exact", cfg.reward_timeout_s, cfg.reward_fallback),
        emu.EmulatedTrainSpec(profile, train_gpus, scale))
    elastic = cfg.policy == "elastic"
    pools = [Pool("gen", 0 if elastic else cfg.gen_workers, 1, {"GEN": 1}, cfg.worker_memory),
             Pool("train", 1, cfg.train_threads, {"TRAIN": 1}, cfg.worker_memory)]
    ledger = EmulatedClockLedger(cfg.prices, scale, profile.gen_cold_start_s)
    deployment = EmulatedDeployment(cfg.scheduler_host, cfg.dashboard_address,
                                    cold_start_wall_s=profile.gen_cold_start_s * scale)
    state = prior_state(cfg, as_live(profile), trace)
    records, peak = [], {"rss_gib": 0.0}
    weights = emu.EmulatedWeights(0)
    with TimedPoolCluster(pools, ledger, deployment=deployment) as pc:
        eg = ElasticGeneration(pc, cfg, run, state, rest_workers=train_gpus / profile.tp)
        for batch in trace.batches:
            it, t0, scaled0 = batch.iteration, time.time(), pc.scaling_wall_s
            table = prompts_table(batch, cfg.seed)
            with get_task_stream(pc.client) as stream:
                if elastic:
                    _, trainables, facts = eg.run_generation(table, weights, it, specs,
                                                             cfg.seed)
                else:
                    trainables, facts = _static_generation(pc, cfg, table, weights, it, specs,
                                                           cfg.seed), {}
                update, published = submit_update(pc.client, trainables, weights, specs.train,
                                                  it, tasks=emu)
                tables, metrics, weights = pc.client.gather([trainables, update, published])
            t1 = time.time()
            timings = (eg.after_update(metrics["update_seconds"], [t.stats for t in tables])
                       if elastic else None)
            rows = Generated.concat(tables).table
            ids = rows.column("prompt_id").to_pylist()
            observe_iteration(state, rows, timings)
            pc.sync_events()
            ledger.mark("iteration", it, t0, t1)
            overhead = _uncovered(stream.data, t0, t1)
            path = max(t.stats.gen_seconds for t in tables) + metrics["update_seconds"]
            late = max((t.stats.late_wall_s for t in tables), default=0.0) \
                + metrics["late_wall_s"]
            memory = worker_memory()
            if memory["rss_gib"] > peak["rss_gib"]:
                peak = memory
            records.append({
                "iteration": it, "step_s": (t1 - t0) / scale, "step_wall_s": t1 - t0,
                "gen_worker_s": ledger.worker_seconds("gen", t1)
                - ledger.worker_seconds("gen", t0),
                "gen_workers": len(pc.worker_names("gen")), "samples": len(rows),
                "distinct_samples": len(set(zip(ids, rows.column("sample_idx").to_pylist()))),
                "update_s": metrics["update_seconds"], "reward_mean": metrics["reward_mean"],
                "overhead_wall_s": overhead, "overhead_s": overhead / scale,
                "overhead_share": overhead / (t1 - t0), "late_wall_s": late,
                "emulated_path_s": path, "runtime_s": (t1 - t0) / scale - path,
                "scaling_wall_s": pc.scaling_wall_s - scaled0,
                "transfer_wall_s": _transfer_s(stream.data), **facts})
            run.append_jsonl("emulated.jsonl", records[-1])
        t_end = time.time()
    return {"iterations": records, "total_s": (t_end - ledger.origin) / scale,
            "gen_worker_s": ledger.worker_seconds("gen", t_end),
            "train_worker_s": ledger.worker_seconds("train", t_end),
            "cold_starts_s": ledger.measured_cold_starts("gen"), "memory_peak": peak,
            "time_scale": scale, "profile": profile.name}
