"""What an emulated run is built from: a workload trace's prompts, a GPU profile's clock.

``backend = "emulated"`` runs through ``train(cfg)`` like every engine; this module gives
the loop what differs (``emulated_inputs``, the emulated side of ``specs.run_inputs``):

- the prompts: batch ``i`` is iteration ``i`` of a synthetic trace
  (``schedulers/sim/workloads.py``, ``emulate_workload``, drawn with ``seed`` for
  ``batch_prompts`` x ``n_samples`` and ``max_new_tokens``), each prompt carrying its group's
  response lengths (``TraceSampler``); the held-out prompts are a trace batch past the run's;
- the engine and the trainer: ``pipeline/tasks/emulated.py``, timed by the profile
  ``emulate_profile`` on ``emulate_train_gpus`` learner GPUs;
- the cluster: generation workers that sleep the profile's cold start before they register
  and run Dask's diagnostics at a low rate (``EmulatedDeployment``);
- the clock: an emulated second lasts ``emulate_time_scale`` wall seconds. The ledger keeps
  emulated seconds (``EmulatedClockLedger`` maps the wall clock), so the policy's inputs (cold
  starts, update seconds, step timings) and the ledger's figures share one unit; the
  iteration record's wall seconds (``iteration_s``) divided by the scale are emulated ones;
- the scaling policy's prior: the throughput model the simulator derives from the profile
  (``prior_policy``), so that the live policy starts where the simulated one does.

``simulator_policy`` and ``as_live`` give the simulator the same policy and profile, for
``bench/emulated.py``'s side-by-side figures.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from rlhfless.ops.engine.engine_types import WeightsRef
from rlhfless.schedulers.ledger import CostLedger
from rlhfless.schedulers.profiles import Profile, get_profile
from rlhfless.schedulers.scaling_policy import ScalingPolicy
from rlhfless.schedulers.sim.sim_policy import PAPER_MECHANISMS, PolicyConfig, SimPolicy
from rlhfless.schedulers.sim.workloads import WORKLOADS, Batch, Trace, synthetic_trace

from ..cluster.deploy import LocalDeployment, Pool
from ..config import Config
from ..tasks import emulated as emu


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

    def records(self, until=None) -> list[dict]:
        return super().records(self.emulated(until))

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
# with these 0.5-0.7 % (docs/emulated.md).
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
            options["preload"] = [*options.get("preload", ()), emu.__name__]
            options["config"] = QUIET_WORKER_CONFIG
            options["env"] = {**options["env"],
                              emu.COLD_START_ENV: str(self.cold_start_wall_s)}
        return spec


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


class TraceSampler:
    """``PromptSampler``'s interface over a trace: the prompts drawn from ``position`` on are
    those of trace batch ``position // batch`` (the trace repeats past its end), so that
    iteration ``i`` of a run gets batch ``i`` of the trace, as the simulator does."""

    def __init__(self, trace: Trace, batch: int, seed: int) -> None:
        self.trace, self.batch, self.seed = trace, batch, seed
        self.position = 0
        self.prompts = pa.concat_tables([prompts_table(b, seed) for b in trace.batches])

    def next_batch(self, n: int | None = None) -> pa.Table:
        want = self.batch if n is None else n
        if want > self.batch:
            raise ValueError(f"next_batch({n}): at most a batch of {self.batch} prompts")
        parts = []
        while want:
            index, offset = divmod(self.position, self.batch)
            take = min(want, self.batch - offset)
            start = (index % len(self.trace.batches)) * self.batch + offset
            parts.append(self.prompts.slice(start, take))
            self.position += take
            want -= take
        return pa.concat_tables(parts) if parts else self.prompts.slice(0, 0)


def run_trace(cfg: Config, extra: int = 1) -> Trace:
    """The run's trace: ``emulate_workload`` for ``iterations`` (plus ``extra`` batches past
    them, the held-out one) of ``batch_prompts`` x ``n_samples``, lengths capped at
    ``max_new_tokens``, drawn with ``seed``."""
    workload = dataclasses.replace(
        WORKLOADS[cfg.emulate_workload], iterations=cfg.iterations + extra,
        batch_prompts=cfg.batch_prompts, n_samples=cfg.n_samples,
        max_response_tokens=cfg.max_new_tokens, seed=cfg.seed,
        dataset_prompts=max(WORKLOADS[cfg.emulate_workload].dataset_prompts, cfg.batch_prompts))
    return synthetic_trace(workload)


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


def prior_policy(cfg: Config, profile: Profile, trace: Trace) -> ScalingPolicy:
    """The policy's starting models: the throughput prior the simulator derives from
    ``as_live(profile)`` (``SimPolicy``), the length predictor with ``cfg.ewma_alpha``."""
    first = trace.batches[0]
    sim = SimPolicy(PolicyConfig(ewma_alpha=cfg.ewma_alpha), as_live(profile), cfg.gen_workers,
                    engine_cap(profile, trace), ctx_hint=float(
                        first.prompt_tokens.mean() + 0.5 * first.lengths.mean()),
                    max_response_tokens=trace.max_response_tokens)
    return ScalingPolicy(cfg.scaling_knobs(), sim.scaling.throughput)


@dataclass(frozen=True)
class Emulation:
    """An emulated run's trace and profile, and what the loop builds from them."""

    cfg: Config
    trace: Trace
    profile: Profile

    @classmethod
    def of(cls, cfg: Config) -> Emulation:
        return cls(cfg, run_trace(cfg), get_profile(cfg.emulate_profile))

    @property
    def engine_options(self) -> dict:
        """``EmulatedEngine``'s options (``EngineSpec.options``)."""
        return {"profile": self.profile.name, "time_scale": self.cfg.emulate_time_scale,
                "cap": engine_cap(self.profile, self.trace)}

    @property
    def learner(self) -> emu.EmulatedLearner:
        return emu.EmulatedLearner(self.profile.name, self.cfg.emulate_train_gpus,
                                   self.cfg.emulate_time_scale)

    @property
    def rest_workers(self) -> float:
        """Generation workers' worth of GPUs billed while the update runs: the learner's."""
        return self.cfg.emulate_train_gpus / self.profile.tp

    def sampler(self) -> TraceSampler:
        return TraceSampler(self.trace.head(self.cfg.iterations), self.cfg.batch_prompts,
                            self.cfg.seed)

    def heldout(self) -> pa.Table:
        """The first ``heldout_prompts`` of the trace batch past the run's."""
        return prompts_table(self.trace.batches[-1], self.cfg.seed).slice(
            0, self.cfg.heldout_prompts)

    def weights(self) -> WeightsRef:
        return WeightsRef(0, emu.WEIGHTS_PATH)

    def ledger(self) -> EmulatedClockLedger:
        return EmulatedClockLedger(self.cfg.prices, self.cfg.emulate_time_scale,
                                   self.profile.gen_cold_start_s)

    def deployment(self, local: LocalDeployment) -> EmulatedDeployment:
        """``local`` (the run's, with its TLS) with emulated generation workers."""
        return EmulatedDeployment(**{f.name: getattr(local, f.name)
                                     for f in dataclasses.fields(local)},
                                  cold_start_wall_s=self.profile.gen_cold_start_s
                                  * self.cfg.emulate_time_scale)

    def scaling(self) -> ScalingPolicy:
        return prior_policy(self.cfg, self.profile, self.trace)
