"""Discrete-event simulator of synchronous RLHF iterations on a cluster of GPUs.

Each iteration of a ``Trace`` runs through the same stages as the live pipeline:

    plan      the policy predicts lengths, picks the worker count and assignment
              (``SimPolicy.plan`` -> ``choose_generation_workers``), reusing warm workers
    generate  every worker: cold start (pre-warmed or waited), weight sync, then continuous
              batching of its groups (``sim_engine``); at tail cut-and-migrate events the
              policy's ``plan_migration`` (or a global cut) moves unfinished sequences
    reward    each worker's finished sequences are scored on CPU as soon as it finishes
    update    the learner (``train_gpus`` GPUs) trains on every (prompt + response) token

Billing goes through ``CostLedger``: pool ``gen`` (one entry per generation worker of ``tp``
GPUs) and pool ``train`` (the learner). ``reserved`` billing starts every worker of the pool
once and stops it at the end of the run (serverful: colocated, the learner shares those
GPUs); ``per_use`` billing starts workers when needed (their cold start billed) and stops
them when released. A released worker stays alive through its predicted idle gap (from the
scaling decision's predicted time and the policy's seconds after generation) when the policy
keeps it (``ScalingPolicy.keeps_alive``: the gap is at most ``keep_alive_s``, or with
``keep_alive_s < 0`` at most a wake from host memory), else it is released at once.

Times are simulated seconds from the run's start. The simulator is deterministic: the
trace fixes all lengths, and nothing is random here.

Simplifications: the serverless pool is assumed to have capacity for pre-warming the learner
while generation still runs; reward runs on CPUs that are not billed; the learner's time
scales perfectly with its GPUs (``Profile.update_seconds``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..ledger import CostLedger
from ..profiles import Profile
from .engine import WorkerRun, simulate_run
from .migrate import MigrationEvents
from .sim_pat import PatEvents
from .sim_policy import PolicyConfig, SimPolicy
from .workloads import Batch, Trace


@dataclass(frozen=True)
class ClusterConfig:
    """GPUs the simulated run may use."""

    gpus: int  # generation pool: at most gpus // tp workers
    train_gpus: int | None = None  # learner GPUs; None: the same number as ``gpus``
    colocated: bool = True  # reserved billing: the learner runs on the generation GPUs
    max_batch: int | None = None  # engine cap on live sequences; None: from the profile

    def to_record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class IterationResult:
    """What one simulated iteration did; times are seconds from the run's start."""

    iteration: int
    t_start: float
    gen_start: float
    gen_end: float
    reward_end: float
    update_start: float
    update_end: float
    n_workers: int
    warm_workers: int
    cold_starts: int
    predicted_gen_s: float
    plan_ms: float
    migrations: int = 0
    moved_sequences: int = 0
    recompute_tokens: int = 0
    decode_tokens: int = 0
    prefill_tokens: float = 0.0
    pred_mape: float | None = None
    gpu_s: float = 0.0  # GPU-seconds billed inside this iteration's span
    forward_s: float = 0.0  # learner seconds of forward-only passes (part of the update)
    tail_forward_gpu_s: float = 0.0  # forward-only GPU-s run on released generation GPUs
    reconfigurations: int = 0  # PAT merges into a higher TP

    @property
    def step_s(self) -> float:
        return self.update_end - self.t_start

    @property
    def gen_s(self) -> float:
        return self.gen_end - self.gen_start

    @property
    def update_s(self) -> float:
        return self.update_end - self.update_start

    def to_record(self) -> dict[str, Any]:
        rec = dataclasses.asdict(self)
        rec.update(step_s=self.step_s, gen_s=self.gen_s, update_s=self.update_s)
        return rec


@dataclass(eq=False)
class SimResult:
    """A simulated run: per-iteration records, the ledger, busy intervals for plots."""

    policy: PolicyConfig
    profile: Profile
    cluster: ClusterConfig
    trace: str
    iterations: list[IterationResult]
    ledger: CostLedger
    gpus_per_worker: dict[str, int]  # pool -> GPUs of one of its workers
    busy: np.ndarray  # [K, 3] (t_start, t_end, gpus) intervals of useful work
    t_end: float
    sequences: list[dict[str, np.ndarray]] = field(default_factory=list)  # keep_sequences

    def gpu_seconds(self) -> float:
        return sum(self.ledger.worker_seconds(pool, until=self.t_end) * g
                   for pool, g in self.gpus_per_worker.items())

    def summary(self) -> dict[str, Any]:
        its = self.iterations
        gpu_s = self.gpu_seconds()
        busy = float(np.sum((self.busy[:, 1] - self.busy[:, 0]) * self.busy[:, 2]))
        return {
            "policy": self.policy.name, "profile": self.profile.name, "trace": self.trace,
            "gpus": self.cluster.gpus, "iterations": len(its),
            "step_s": float(np.mean([i.step_s for i in its])),
            "gen_s": float(np.mean([i.gen_s for i in its])),
            "update_s": float(np.mean([i.update_s for i in its])),
            "total_s": self.t_end, "gpu_s": gpu_s, "gpu_s_per_iteration": gpu_s / len(its),
            "cost_usd": gpu_s * self.profile.price_per_gpu_s,
            "utilisation": busy / gpu_s if gpu_s else 0.0,
            "mean_workers": float(np.mean([i.n_workers for i in its])),
            "cold_starts": int(sum(i.cold_starts for i in its)),
            "migrations": int(sum(i.migrations for i in its)),
            "reconfigurations": int(sum(i.reconfigurations for i in its)),
            "plan_ms": float(np.mean([i.plan_ms for i in its])),
        }

    def records(self) -> list[dict[str, Any]]:
        return [i.to_record() for i in self.iterations]

    def to_record(self) -> dict[str, Any]:
        """Summary, configuration and per-iteration records, JSON-able."""
        return {"summary": self.summary(), "policy": self.policy.to_record(),
                "profile": self.profile.to_record(), "cluster": self.cluster.to_record(),
                "iterations": self.records()}

    def utilisation(self, bins: int = 200) -> dict[str, np.ndarray]:
        """GPUs billed and GPUs busy, averaged over ``bins`` equal time bins."""
        edges = np.linspace(0.0, self.t_end, bins + 1)
        rows = [r for r in self.ledger.records(until=self.t_end) if r["kind"] == "worker"]
        billed = np.array([[r["t_start"], r["t_end"] if r["t_end"] is not None else self.t_end,
                            self.gpus_per_worker[r["pool"]]] for r in rows]).reshape(-1, 3)

        def per_bin(iv: np.ndarray) -> np.ndarray:
            lo = np.maximum(edges[:-1, None], iv[None, :, 0])
            hi = np.minimum(edges[1:, None], iv[None, :, 1])
            return (np.clip(hi - lo, 0, None) * iv[None, :, 2]).sum(axis=1) / np.diff(edges)

        return {"t": 0.5 * (edges[:-1] + edges[1:]), "billed_gpus": per_bin(billed),
                "busy_gpus": per_bin(self.busy)}


class _Pool:
    """Workers of one ledger pool: awake ones (billed; idle ones wait here with an expiry),
    asleep ones (released: weights in host memory, no GPU billed) and never-started ones."""

    def __init__(self, ledger: CostLedger, pool: str) -> None:
        self.ledger, self.pool = ledger, pool
        self.awake: dict[str, tuple[float, float]] = {}  # name -> (idle since, expiry)
        self.asleep: list[str] = []
        self.n_started = 0

    def expire(self, t: float) -> None:
        """Workers whose keep-alive ran out before ``t`` go to sleep at their expiry."""
        for name, (since, expiry) in list(self.awake.items()):
            if expiry < t:
                self.sleep(name, max(since, expiry))

    def sleep(self, name: str, t: float) -> None:
        self.ledger.worker_stopped(name, t)
        del self.awake[name]
        self.asleep.append(name)

    def take(self, k: int, t: float, cold_s: float, wake_s: float,
             prewarm: bool) -> list[tuple[str, float, str]]:
        """``k`` workers needed at ``t``: awake ones first, then woken, then new ones.
        Returns (name, ready time, "warm" | "wake" | "cold"); a pre-warmed start is billed
        from ``t - start seconds`` and ready at ``t``."""
        out = []
        for name in list(self.awake)[:k]:
            del self.awake[name]
            out.append((name, t, "warm"))
        while len(out) < k:
            if self.asleep:
                name, kind, secs = self.asleep.pop(), "wake", wake_s
            else:
                name, kind, secs = f"{self.pool}-{self.n_started}", "cold", cold_s
                self.n_started += 1
            if prewarm:
                self.ledger.worker_started(name, self.pool, t, cold_start_s=secs)
                ready = t
            else:
                self.ledger.worker_started(name, self.pool, t)
                ready = t + secs
            self.ledger.worker_ready(name, ready)
            out.append((name, ready, kind))
        return out

    def close(self, t_end: float) -> None:
        for name, (since, expiry) in list(self.awake.items()):
            self.sleep(name, max(since, min(expiry, t_end)))


class Simulator:
    """Runs a trace under one policy; ``run()`` returns a ``SimResult``."""

    def __init__(self, trace: Trace, profile: Profile, cluster: ClusterConfig,
                 policy: PolicyConfig, keep_sequences: bool = False) -> None:
        if not trace.batches:
            raise ValueError(f"Simulator: trace {trace.name!r} has no batches")
        if policy.engine != profile.engine or policy.tp not in (None, profile.tp):
            profile = profile.variant(policy.engine, policy.tp)
        self.profile = profile
        self.pool_size = cluster.gpus // profile.tp
        if self.pool_size < 1:
            raise ValueError(f"Simulator: {cluster.gpus} GPUs cannot hold one worker of "
                             f"tp={profile.tp} ({profile.name}); allowed: gpus >= tp")
        self.trace, self.cluster, self.cfg = trace, cluster, policy
        self.train_gpus = int(cluster.train_gpus or cluster.gpus)
        first = trace.batches[0]
        self.cap = int(cluster.max_batch or profile.batch_cap(
            float(first.prompt_tokens.mean() + first.lengths.mean())))
        self.policy = SimPolicy(policy, profile, self.pool_size, self.cap, ctx_hint=float(
            first.prompt_tokens.mean() + 0.5 * first.lengths.mean()),
            max_response_tokens=trace.max_response_tokens)
        price = profile.price_per_gpu_s
        self.gpus = {"gen": profile.tp, "train": self.train_gpus}
        self.ledger = CostLedger({p: g * price for p, g in self.gpus.items()})
        self.gen, self.learner = _Pool(self.ledger, "gen"), _Pool(self.ledger, "train")
        self.keep_sequences = keep_sequences
        self.reserved = policy.billing == "reserved"
        self.switch_s = profile.gen_wake_s if self.reserved and cluster.colocated else 0.0
        self.busy: list[tuple[float, float, float]] = []
        self.results: list[IterationResult] = []
        self.sequences: list[dict[str, np.ndarray]] = []
        self.clock = 0.0
        if self.reserved:  # the whole pool starts once, cold, and runs to the end
            train_cold = profile.train_start_seconds(self.train_gpus, cold=True)
            pools = [(self.gen, self.pool_size, profile.gen_cold_start_s)]
            if not cluster.colocated:
                pools.append((self.learner, 1, train_cold))
            for pool, k, cold in pools:
                for name, ready, _ in pool.take(k, 0.0, cold, cold, prewarm=False):
                    pool.awake[name] = (ready, math.inf)
                    self.clock = max(self.clock, ready)
            if cluster.colocated:  # the learner initialises on the same GPUs meanwhile
                self.clock = max(self.clock, train_cold)
        else:  # first workers are pre-warmed (or waited for) from time 0
            self.clock = profile.gen_cold_start_s if policy.prewarm else 0.0

    def _expiry(self, t: float, idle_gap_s: float, restart_s: float) -> float:
        """Until when a worker released at ``t`` stays awake (billed): reserved billing
        keeps it; else the policy keeps it through ``idle_gap_s`` or releases it now."""
        if self.reserved or self.policy.scaling.keeps_alive(idle_gap_s, restart_s):
            return math.inf
        return t

    # ---- one iteration ---------------------------------------------------------------------

    def step(self, batch: Batch) -> IterationResult:
        prof, cfg = self.profile, self.cfg
        t = self.clock
        self.gen.expire(t)
        n_warm = len(self.gen.awake)
        started = time.perf_counter()
        decision = self.policy.plan(batch, keep_warm=n_warm,
                                    rest_workers=self.train_gpus / prof.tp)
        plan_ms = 1e3 * (time.perf_counter() - started)
        n_workers = decision.n_workers
        t_gen = t + prof.iteration_overhead_s
        if not self.reserved:
            for name in list(self.gen.awake)[n_workers:]:
                self.gen.sleep(name, t)
        taken = self.gen.take(n_workers, t_gen, prof.gen_cold_start_s, prof.gen_wake_s,
                              cfg.prewarm)
        n = batch.n_samples
        length = batch.lengths.ravel().astype(np.int64)
        prompt = np.repeat(batch.prompt_tokens.astype(np.int64), n)
        pf_group = self.policy.prefill_per_group(batch)
        runs: dict[str, WorkerRun] = {}
        for (name, ready, _), groups in zip(taken, decision.assignment, strict=True):
            groups = np.asarray(groups, dtype=np.int64)
            seqs = (groups[:, None] * n + np.arange(n)).ravel()
            if cfg.dedup:
                pre = np.zeros(seqs.size)
                pre[::n] = pf_group[groups]
                pre[:1] += batch.shared_prefix_tokens
            else:
                pre = prompt[seqs].astype(np.float64)
            runs[name] = simulate_run(ready + self.switch_s + prof.sync_s, seqs, length[seqs],
                                      prompt[seqs], pre, prof, self.cap)
        mig = MigrationEvents(self.policy, prof, self.cap, batch, runs, length, prompt)
        mig.run()
        pat = PatEvents(mig, 1.0 if self.reserved else cfg.lambda_cost)
        if cfg.pat:
            pat.run()
        finish = mig.finish_times()
        gen_end = max(finish.values())
        n_done = mig.finished_per_worker()
        reward_end = max(f + prof.reward_seconds(n_done[w]) for w, f in finish.items())
        update_start = reward_end
        if not self.reserved:
            self.learner.expire(reward_end)
            (name, update_start, _), = self.learner.take(
                1, reward_end, prof.train_start_seconds(self.train_gpus, cold=True),
                prof.train_start_seconds(self.train_gpus, cold=False), cfg.prewarm)
        tokens = float(length.sum() + (batch.prompt_tokens.sum() if cfg.shared_prompt_forward
                                       else prompt.sum()))
        forward_gpu_s = prof.forward_seconds(tokens, 1)
        finish, in_tail = self._tail_forwards(finish, mig, forward_gpu_s, gen_end)
        forward_s = (forward_gpu_s - in_tail) / self.train_gpus
        update_end = update_start + forward_s + prof.update_seconds(tokens, self.train_gpus)
        if not self.reserved:
            wake = prof.train_start_seconds(self.train_gpus, cold=False)
            # next used after the next generation and reward, as long as this one's
            self.learner.awake[name] = (update_end, self._expiry(
                update_end, reward_end - t, wake))
        gen_planned_end = t_gen + decision.predicted_seconds
        for name, f in finish.items():
            # idle until the planned end of generation, then through the reward and update
            self.gen.awake[name] = (f, self._expiry(
                f, self.policy.scaling.idle_gap_s(gen_planned_end - f), prof.gen_wake_s))
        all_runs = mig.all_runs()
        self.busy.extend((r.t0, r.t_finish, r.gpus) for r in all_runs if r.n_steps)
        self.busy.append((update_start, update_end, self.train_gpus))
        for stage, a, b in (("plan", t, t_gen), ("generate", t_gen, gen_end),
                            ("reward", gen_end, reward_end), ("update", update_start, update_end)):
            self.ledger.mark(stage, batch.iteration, a, b)
        error = self.policy.observe(batch, all_runs, update_end - gen_end)
        if self.keep_sequences:
            self.sequences.append(mig.sequence_log())
        self.clock = update_end
        res = IterationResult(
            iteration=batch.iteration, t_start=t, gen_start=t_gen, gen_end=gen_end,
            reward_end=reward_end, update_start=update_start, update_end=update_end,
            n_workers=n_workers, warm_workers=sum(k == "warm" for _, _, k in taken),
            cold_starts=sum(k == "cold" for _, _, k in taken),
            predicted_gen_s=decision.predicted_seconds, plan_ms=plan_ms,
            migrations=mig.n_migrations, moved_sequences=mig.n_moved,
            recompute_tokens=mig.recompute_tokens, decode_tokens=int(length.sum()),
            prefill_tokens=float(sum(r.prefill.sum() for r in all_runs)),
            pred_mape=error.get("mape"), forward_s=forward_s, tail_forward_gpu_s=in_tail,
            reconfigurations=pat.n_reconfigurations)
        self.results.append(res)
        return res

    def _tail_forwards(self, finish: dict[str, float], mig: MigrationEvents, work_gpu_s: float,
                       gen_end: float) -> tuple[dict[str, float], float]:
        """Forward-only passes on generation GPUs released before ``gen_end`` (policy
        ``tail_forwards``). A released worker loads the reference weights from host memory
        (a wake's transfer), then forwards finished sequences until ``gen_end``; only the
        work of sequences finished before the last worker's release is eligible. Returns
        each worker's new release time (it stays billed while it forwards) and the GPU-s
        done there."""
        if not self.cfg.tail_forwards or work_gpu_s <= 0 or len(finish) < 2:
            return finish, 0.0
        prof = self.profile
        ends = np.concatenate([r.finish_times() for r in mig.all_runs()])
        ends = ends[np.isfinite(ends)]
        second_last = sorted(finish.values())[-2]
        eligible = work_gpu_s * float(np.mean(ends <= second_last)) if ends.size else 0.0
        load = prof.gen_wake_s
        window = {w: max(gen_end - f - load, 0.0) * prof.tp for w, f in finish.items()}
        total = sum(window.values())
        done = min(eligible, total)
        if done <= 0:
            return finish, 0.0
        out = {}
        for w, f in finish.items():
            used = done * window[w] / total
            out[w] = f + load + used / prof.tp if used > 0 else f
            if used > 0:
                self.busy.append((f, out[w], prof.tp))
        return out, done

    def run(self) -> SimResult:
        for batch in self.trace.batches:
            self.step(batch)
        t_end = self.clock
        self.gen.close(t_end)
        self.learner.close(t_end)
        by_it = {r["iteration"]: r for r in self.ledger.by_iteration()}
        for res in self.results:
            row = by_it[res.iteration]
            res.gpu_s = sum(row[f"{p}_worker_s"] * g for p, g in self.gpus.items())
        return SimResult(self.cfg, self.profile, self.cluster, self.trace.name, self.results,
                         self.ledger, dict(self.gpus), np.array(self.busy).reshape(-1, 3),
                         t_end, self.sequences)


def simulate(trace: Trace, profile: Profile, cluster: ClusterConfig, policy: PolicyConfig,
             keep_sequences: bool = False) -> SimResult:
    """Run ``trace`` under ``policy`` on ``cluster`` with ``profile``'s timings."""
    return Simulator(trace, profile, cluster, policy, keep_sequences).run()

