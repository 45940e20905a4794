"""The scaling policy (``policy = "elastic"``): one pure object that the live runtime and the
simulator both call. "Scaling policy" is the scheduler's; "policy" alone, in this project, is
the RL model.

``ScalingKnobs`` declares the policy's knobs once (the run configuration builds them with
``Config.scaling_knobs``; the simulator's ``PolicyConfig`` extends them with which mechanisms
a simulated system uses). ``ScalingPolicy`` holds what the policy learns across iterations
(the length predictor, the throughput model, the seconds that follow generation) and makes
every decision the elastic pool takes; it knows nothing of Dask, of workers' processes or of
simulated clocks. Call order, per iteration:

1. ``predict`` the prompts' response lengths (and ``predict_env`` their episodes' seconds
   outside the model), then ``plan`` the pool: how many generation workers and which prompt
   groups each gets (``choose_generation_workers``: the lowest λ·time + (1-λ)·worker-seconds,
   warm workers first; groups whose episodes wait long spread across workers);
2. while generation runs: when a worker pauses between chunks (the live runtime pauses its
   chunk at completion ``tau``; the simulator when its live batch falls to ``tail_batch``),
   ``migrate`` says which tails move and where (``plan_migration``: the tails of the fleet
   planned jointly, never later than staying; the predicted tokens still to come are
   ``remaining``, conditioned on what each sequence has generated), and ``kv_path`` whether
   each move ships its KV cache or recomputes its context (``KvCosts``); where the engine
   can split a paused batch or consolidate tails and the run has measured its
   ``step_profile``, the live runtime pauses the whole pool and ``choose_tail`` weighs
   staying, those moves, a split and a reconfiguration by predicted finish
   (``tail_choice.py``);
3. when a worker is idle: ``keeps_alive(idle_gap_s(...))`` says whether to keep it through
   the predicted gap until its next use, or release it now (break-even keep-alive: idling
   longer than a restart costs more than the restart);
4. after the iteration: ``observe_iteration``, the one call per iteration that feeds the
   models what it measured (the lengths and seconds outside the model; with an elastic pool
   the shards' decode and prefill timings and version fetches, the cold starts and the
   seconds after generation). ``observe_move`` is the one
   observation taken during the iteration, as each move lands, so that the iteration's later
   moves are priced with it.

``state_dict`` / ``load_state_dict`` round-trip everything it learned (checkpoints).

``sizing`` hands the scheduler a ``PoolSizing``: a snapshot of the policy (its throughput
model and the seconds that follow generation, not its predictor) that sizes the pool from
the generation work queued in the scheduler, with the same ``plan`` and keep-alive. Queued
work is in units that are never split between workers (a prompt group, a paused tail's
sequence, a whole task of the static graph), each with its predicted response tokens, its
longest sequence and its prompt tokens (``predict_work``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from numpy.typing import ArrayLike

from .assignment import assign_by_length
from .migration import Migration, WorkerProgress, plan_migration, tail_batch
from .predictor import LengthPredictor, remaining_tokens
from .scaling import Assign, ScalingDecision, choose_generation_workers, round_robin
from .tail_choice import Tail, TailChoice, choose_tail
from .tail_cost import KvChoice, KvCosts, StepProfile, TransferModel
from .throughput import ThroughputModel

ASSIGNMENTS = ("length", "round_robin", "replay")


class ShardTimings(Protocol):
    """What one generation shard measured (``GenerationStats`` of the live runtime)."""

    decode_tokens: int  # sum over the decode steps of the live batch size
    decode_steps: int
    decode_seconds: float
    prefill_tokens: int
    prefill_seconds: float
    weight_fetch_s: float  # getting a newer version into the engine first (0: none needed)
    episodes: Any  # multi-turn or agent shards: ``env_wait_seconds`` decoding nothing; else None


@dataclass(frozen=True)
class IterationTimings:
    """What an iteration of an elastic pool measured, beside its lengths."""

    after_generation_s: float  # from the end of generation to the end of the step
    shards: Sequence[ShardTimings]  # each generation shard's counters
    cold_starts: Sequence[float]  # every generation cold start of the run so far


@dataclass(frozen=True)
class Release:
    """Whether an idle generation worker goes now: its predicted idle gap against the
    keep-alive (``ScalingPolicy.release_idle``)."""

    release: bool
    gap_s: float
    keep_alive_s: float

    @property
    def reason(self) -> str:
        return (f"idle gap {self.gap_s:.2f} s {'>=' if self.release else '<'} keep-alive "
                f"{self.keep_alive_s:.2f} s")


@dataclass(frozen=True, kw_only=True)
class ScalingKnobs:
    """The elastic policy's knobs, with the defaults of live runs and simulations alike."""

    lambda_cost: float = 0.5  # 1: fastest worker count, 0: cheapest (worker-seconds)
    tau: float = 0.7  # completion fraction at which a live worker's chunk pauses for migrate
    ewma_alpha: float = 1.0  # weight of the newest observation in the policy's EWMAs
    keep_alive_s: float = -1.0  # idle seconds a worker is kept; < 0: break-even with a restart
    assignment: str = "length"  # prompts of similar predicted length on one worker

    def __post_init__(self) -> None:
        for key, ok, allowed in (
            ("lambda_cost", 0.0 <= self.lambda_cost <= 1.0, "[0, 1]"),
            ("tau", 0.0 < self.tau <= 1.0, "(0, 1]"),
            ("ewma_alpha", 0.0 < self.ewma_alpha <= 1.0, "(0, 1]"),
            ("keep_alive_s", np.isfinite(self.keep_alive_s), "a finite number of seconds "
                                                              "(< 0: break-even)"),
            ("assignment", self.assignment in ASSIGNMENTS, str(ASSIGNMENTS)),
        ):
            if not ok:
                raise ValueError(f"{key} = {getattr(self, key)!r}; allowed: {allowed}")

    def knobs(self) -> ScalingKnobs:
        """Only the knobs (of a subclass that adds more fields)."""
        return ScalingKnobs(**{f.name: getattr(self, f.name)
                               for f in dataclasses.fields(ScalingKnobs)})


class ScalingPolicy:
    """Decisions and learned state of the elastic policy; see the module docstring."""

    def __init__(self, knobs: ScalingKnobs, throughput: ThroughputModel | None = None,
                 kv_seconds_per_token: float | None = None,
                 transfer: TransferModel | None = None) -> None:
        self.knobs = knobs.knobs()
        self.predictor = LengthPredictor(alpha=knobs.ewma_alpha)
        self.throughput = throughput if throughput is not None else ThroughputModel()
        self.kv_seconds_per_token = kv_seconds_per_token  # None: a moved tail is recomputed
        self.kv = KvCosts(self.throughput, transfer)  # a live move: transfer or recompute
        self.update_seconds = 0.0  # EWMA of the seconds after generation (0: none seen yet)
        self.planned_generation_s = 0.0  # the last plan's predicted generation seconds
        self.seen_cold_starts = 0  # cold starts already fed to the throughput model
        # decode step seconds by batch x threads, measured by the run on its pool (the
        # tail decision's clock; None until measured: then tails only stay or move)
        self.step_profile: StepProfile | None = None

    # ---- plan --------------------------------------------------------------------------

    def predict(self, prompt_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Predicted (mean, max) response tokens of each prompt's group."""
        return self.predictor.predict(prompt_ids), self.predictor.predict_max(prompt_ids)

    def predict_env(self, prompt_ids: Sequence[str]) -> np.ndarray:
        """Predicted seconds outside the model of each of a prompt's episodes (0 without
        environments or agents)."""
        return self.predictor.predict_env(prompt_ids)

    def predict_work(self, prompt_ids: Sequence[str], prompt_tokens: ArrayLike,
                     n_samples: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each prompt group's predicted work: (response tokens of its ``n_samples``
        samples, its longest sample, its prompt tokens), the units of ``PoolSizing``."""
        mean, longest = self.predict(prompt_ids)
        return mean * n_samples, longest, np.asarray(prompt_tokens, dtype=np.float64)

    def assign(self) -> Assign:
        """The assignment the knobs ask for (``replay`` is the simulator's own)."""
        return round_robin if self.knobs.assignment == "round_robin" else assign_by_length

    def plan(self, pred_mean: np.ndarray, pred_max: np.ndarray, n_samples: int,
             prompt_tokens: np.ndarray, *, keep_warm: int, max_workers: int,
             min_workers: int = 1, assign: Assign | None = None,
             rest_workers: float | None = None,
             pred_env: np.ndarray | None = None) -> ScalingDecision:
        """This iteration's worker count and assignment. ``rest_workers``: the rest of the
        step (what follows generation, ``update_seconds`` as last seen) is scored with it,
        billed at that many generation workers' worth (the trainer's workers, or GPUs / TP);
        None: generation alone is scored. ``pred_env``: ``predict_env`` of the groups (None:
        assigned by length alone). See ``choose_generation_workers``."""
        rest_s = 0.0 if rest_workers is None else self.update_seconds
        decision = choose_generation_workers(
            pred_mean, n_samples, self.throughput, max_workers=max_workers,
            min_workers=min_workers, lambda_cost=self.knobs.lambda_cost, keep_warm=keep_warm,
            assign=assign or self.assign(), pred_max_lengths=pred_max,
            prompt_tokens=prompt_tokens, fixed_seconds=rest_s,
            fixed_cost_ws=rest_s * (rest_workers or 0.0), pred_env_seconds=pred_env)
        self.planned_generation_s = decision.predicted_seconds
        return decision

    # ---- the tail ----------------------------------------------------------------------

    def remaining(self, pred_max: ArrayLike, generated: ArrayLike,
                  max_tokens: int | None) -> np.ndarray:
        """Predicted tokens still to decode of unfinished sequences, given what each has
        generated (``predictor.remaining_tokens``)."""
        return remaining_tokens(pred_max, generated, max_tokens)

    def tail_batch(self) -> float:
        """Live sequences at or below which a worker is in its tail (``tail_batch`` of the
        throughput model): when its tail is worth a migration decision."""
        return tail_batch(self.throughput)

    def migrate(self, progress: Mapping[str, WorkerProgress],
                kv_transfer: bool = False) -> list[Migration]:
        """Which paused tails move, and where (``plan_migration``: triggered by the tail,
        not by a completion count). ``kv_transfer``: the runtime can ship KV caches, so a
        moved token costs what the fitted transfer model says (unless
        ``kv_seconds_per_token`` was given)."""
        kv_s = self.kv_seconds_per_token
        if kv_s is None and kv_transfer:
            kv_s = self.kv.seconds_per_token()
        return plan_migration(progress, None, self.throughput,
                              lambda_cost=self.knobs.lambda_cost, kv_seconds_per_token=kv_s)

    def kv_path(self, context_tokens: int) -> KvChoice:
        """How one move's context reaches its target: its KV cache or a recomputation,
        whichever is predicted faster (``tail_cost.choose_kv_path``)."""
        return self.kv.choose(context_tokens)

    def choose_tail(self, progress: Mapping[str, WorkerProgress], tails: Mapping[str, Tail],
                    threads: Mapping[str, int], supported: frozenset[str],
                    kv_transfer: bool, force: str = "") -> TailChoice:
        """Stay, move, split or reconfigure the pool's paused ``tails`` (``tail_choice``),
        timed by ``step_profile``; ``progress``: every worker's, as ``migrate`` reads it
        (the workers of ``threads`` without a tail are idle); ``kv_transfer``: a moved
        context may travel as its KV cache; ``force``: an engine tail action to take
        whatever it costs ("": choose)."""
        def move_s(tokens: int) -> float:
            choice = self.kv_path(tokens)
            return choice.predicted_s if kv_transfer else choice.recompute_s

        migrations = [] if force else self.migrate(progress, kv_transfer=kv_transfer)
        idle = [w for w in threads if w not in tails]
        return choose_tail(tails, idle, threads, self.step_profile, supported, migrations,
                           move_s, force)

    # ---- idle workers ------------------------------------------------------------------

    def keep_alive_s(self, restart_s: float | None = None) -> float:
        """Idle seconds worth keeping a worker for: the knob, or break-even with
        ``restart_s`` (default: the throughput model's cold start)."""
        if self.knobs.keep_alive_s >= 0:
            return self.knobs.keep_alive_s
        return self.throughput.cold_start_s if restart_s is None else restart_s

    def rest_of_step_s(self) -> float:
        """Seconds from the end of generation to the end of the step: as measured; before the
        first measurement, the planned generation's seconds (published verl steps spend
        25–50 % of a step generating, so the rest is at least as long as generation)."""
        return self.update_seconds if self.update_seconds > 0 else self.planned_generation_s

    def idle_gap_s(self, generation_left_s: float) -> float:
        """Predicted seconds until an idle generation worker is used again: the rest of this
        generation, then what follows it."""
        return max(generation_left_s, 0.0) + self.rest_of_step_s()

    def keeps_alive(self, idle_gap_s: float, restart_s: float | None = None) -> bool:
        """Keep an idle worker through ``idle_gap_s`` (shorter than the keep-alive), or
        release it now."""
        return idle_gap_s < self.keep_alive_s(restart_s)

    def release_idle(self, busy: Sequence[WorkerProgress]) -> Release:
        """Whether to release an idle generation worker now, while ``busy`` workers still
        generate: it would idle until the busiest finishes (the throughput model's seconds
        for its remaining tokens) and then through the rest of the step (``idle_gap_s``);
        kept when that is shorter than the keep-alive."""
        left = max((self.throughput.predict_worker_seconds(np.asarray(p.remaining_tokens), 0)
                    for p in busy), default=0.0)
        gap = self.idle_gap_s(left)
        return Release(not self.keeps_alive(gap), gap, self.keep_alive_s())

    def sizing(self, n_samples: int, max_workers: int,
               rest_workers: float | None = None) -> PoolSizing:
        """The rule that sizes the pool from queued work, for the scheduler: a picklable
        snapshot of what ``plan`` and ``keeps_alive`` read (not the predictor: the queued
        work carries its predictions)."""
        snapshot = ScalingPolicy(self.knobs, copy.deepcopy(self.throughput))
        snapshot.update_seconds = self.update_seconds
        snapshot.planned_generation_s = self.planned_generation_s
        return PoolSizing(snapshot, n_samples, max_workers, rest_workers)

    # ---- observe -----------------------------------------------------------------------

    def observe_iteration(self, prompt_ids: Sequence[str], lengths: Sequence[int],
                          timings: IterationTimings | None = None, *,
                          env_seconds: Sequence[float] | None = None) -> dict[str, Any]:
        """Everything an iteration measured, once per iteration: its rows' response
        ``lengths`` and ``env_seconds`` (``observe_lengths``: returns the predictor's error
        on them) and, with an elastic pool, its ``timings`` (a static pool has none to learn
        from)."""
        if timings is not None:
            self.observe_after_generation(timings.after_generation_s)
            for stats in timings.shards:
                steps = stats.decode_steps
                if steps:
                    self.observe_decode(stats.decode_tokens / steps,
                                        stats.decode_seconds / steps, n_steps=steps)
                    if self.step_profile is not None:  # at the pool's own threads
                        self.step_profile.observe(stats.decode_tokens / steps,
                                                  self.step_profile.threads[0],
                                                  stats.decode_seconds / steps)
                if stats.prefill_tokens and stats.prefill_seconds:
                    self.observe_prefill(stats.prefill_tokens, stats.prefill_seconds)
                if stats.episodes is not None:  # multi-turn or agent episodes
                    self.throughput.observe_env_wait(stats.episodes.env_wait_seconds)
                if stats.weight_fetch_s:  # a shard whose worker had the version pays none
                    self.throughput.observe_weight_fetch(stats.weight_fetch_s)
            self.observe_cold_starts(timings.cold_starts)
        return self.observe_lengths(prompt_ids, lengths, env_seconds)

    def observe_lengths(self, prompt_ids: Sequence[str], lengths: Sequence[int],
                        env_seconds: Sequence[float] | None = None) -> dict[str, Any]:
        """The predictor's error on these lengths and each sample's seconds outside the
        model (predicted before it saw them; None: no environment, 0 s), then learn them."""
        error = self.predictor.error(prompt_ids, lengths, env_seconds)
        self.predictor.observe(prompt_ids, lengths, env_seconds)
        return error

    def observe_after_generation(self, seconds: float) -> None:
        """Seconds from the end of generation to the end of the step (the idle gap)."""
        alpha = self.knobs.ewma_alpha if self.update_seconds > 0 else 1.0
        self.update_seconds = alpha * seconds + (1.0 - alpha) * self.update_seconds

    def observe_decode(self, batch: ArrayLike, step_seconds: ArrayLike,
                       n_steps: ArrayLike | None = None) -> None:
        self.throughput.observe_decode(batch, step_seconds, n_steps=n_steps)

    def observe_prefill(self, tokens: float, seconds: float) -> None:
        self.throughput.observe_prefill(tokens, seconds)

    def observe_move(self, path: str, context_tokens: int, nbytes: int, seconds: float,
                     learn_prefill: bool = True) -> None:
        """A move's actual seconds (``KvCosts.observe``)."""
        self.kv.observe(path, context_tokens, nbytes, seconds, learn_prefill)

    def observe_cold_starts(self, cold_starts: Sequence[float]) -> None:
        """Every cold start of the run so far (a ledger's); the new ones are learned."""
        for seconds in cold_starts[self.seen_cold_starts:]:
            self.throughput.observe_cold_start(seconds)
        self.seen_cold_starts = len(cold_starts)

    # ---- checkpoints -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"predictor": self.predictor.state_dict(),
                "throughput": self.throughput.state_dict(),
                "update_seconds": self.update_seconds, "kv": self.kv.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.predictor.load_state_dict(state["predictor"])
        self.throughput.load_state_dict(state["throughput"])
        self.update_seconds = float(state["update_seconds"])
        if state.get("kv"):  # checkpoints written before KV moves were learned have none
            self.kv.load_state_dict(state["kv"])


@dataclass(frozen=True)
class PoolSizing:
    """How many workers the queued generation work wants: ``ScalingPolicy.plan`` of it,
    ``keeps_alive`` when none is queued. Made by ``ScalingPolicy.sizing``; pure (but for
    the snapshot's own ``planned_generation_s``) and picklable, so that it runs inside the
    scheduler (``ElasticityPlugin``)."""

    scaling: ScalingPolicy  # a snapshot: throughput model, knobs, seconds after generation
    n_samples: int  # samples per prompt group
    max_workers: int  # the pool's maximum
    rest_workers: float | None = None  # see ScalingPolicy.plan

    def target(self, tokens: ArrayLike, longest: ArrayLike, prompt_tokens: ArrayLike, *,
               current: int, held: int = 0, room: int | None = None) -> tuple[int, str]:
        """(workers, reason) for the queued units (``ScalingPolicy.predict_work``'s
        arrays); ``current``: workers in the pool (warm); ``held``: workers the queued work
        is pinned to (never fewer); ``room``: the most workers it can use (pinned workers
        plus tasks free to go anywhere; None: no bound). Nothing queued: the pool is kept
        through the predicted idle gap if that is shorter than the keep-alive, else
        released down to ``held``."""
        tokens = np.asarray(tokens, dtype=np.float64)
        scaling = self.scaling
        if not tokens.size:
            gap, keep = scaling.idle_gap_s(0.0), scaling.keep_alive_s()
            if scaling.keeps_alive(gap):
                return current, f"queue drained; idle gap {gap:.2f} s < keep-alive {keep:.2f} s"
            return held, f"queue drained; idle gap {gap:.2f} s >= keep-alive {keep:.2f} s"
        decision = scaling.plan(tokens / self.n_samples, np.asarray(longest, np.float64),
                               self.n_samples, np.asarray(prompt_tokens, np.float64),
                               keep_warm=current, max_workers=self.max_workers,
                               rest_workers=self.rest_workers)
        n = max(decision.n_workers if room is None else min(decision.n_workers, room), held)
        return n, (f"{tokens.size} queued units, {tokens.sum():.0f} predicted tokens: "
                   f"argmin λ·T+(1-λ)·C = {decision.n_workers} workers"
                   + (f", {n} usable" if n != decision.n_workers else ""))
