"""Policies the simulator runs: configurations over the live scheduler's policy objects.

A ``PolicyConfig`` says which mechanisms are on; ``SimPolicy`` wires them to the same pure
policies the live scheduler calls, so a baseline is a configuration, never a copy:

- length prediction: ``LengthPredictor`` (EWMA, ``ewma_alpha``), or the true lengths (oracle);
- scaling: ``choose_generation_workers`` over ``1..pool`` (elastic) or the whole pool (static),
  with a ``ThroughputModel`` fitted online from the simulated workers' own step timings;
- assignment: ``assign_by_length`` (RLHFless), ``round_robin`` (verl's even split of the batch
  over its engines: each engine gets the same number of groups, i.e. least-loaded by count),
  or the groups' logged workers (replay of a recorded run);
- cut-and-migrate: ``plan_migration`` on the tails (local, RLHFless), or a global
  cut (RLHFuse-like: once ``tau`` of all sequences are done, the unfinished ones are
  consolidated onto the fewest workers that hold them and the others are released);
- prefill dedup: each group's prompt prefilled once per worker (and the batch's shared prefix
  once per worker), or every sample prefilled on its own;
- billing: ``reserved`` (every GPU billed from the run's start to its end, serverful) or
  ``per_use`` (a worker is billed from its start, cold start included, until it stops);
- engine: how the generation engine runs (``profiles.ENGINES``: verl 0.3's defaults, a tuned
  verl, or our dedicated actors) and an optional TP;
- learner: the shared-prompt forward (each group's prompt forwarded once in the update and
  the forward-only passes, as ``ops/engine/forward.py`` does) and the forward-only passes (old
  log-probs, reference) run on generation GPUs released while the tail still decodes;
- whole-step scoring: the scaling score adds the update that follows generation;
- PAT: a node's live workers merged into a higher TP in the generation tail (``sim_pat``).

``VERL_03`` and ``VERL_TUNED`` are the serverful baselines; ``PAPER_MECHANISMS`` is RLHFless's
four mechanisms; ``ELASTIC`` is everything ours (``ablations()`` builds it step by step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..migration import Migration, WorkerProgress
from ..profiles import ENGINES, Profile
from ..scaling import ScalingDecision
from ..scaling_policy import ScalingKnobs, ScalingPolicy
from ..throughput import ThroughputModel
from .workloads import Batch

CHOICES = {
    "billing": ("reserved", "per_use"),
    "scaling": ("elastic", "static"),
    "migration": ("none", "local", "global"),
    "engine": tuple(ENGINES),
}


@dataclass(frozen=True)
class PolicyConfig(ScalingKnobs):
    """Which mechanisms a simulated system uses (see the module docstring), over the elastic
    policy's knobs (``ScalingKnobs``: ``tau``, ``lambda_cost``, ``ewma_alpha``,
    ``keep_alive_s``, ``assignment``, with the live runs' defaults)."""

    name: str = "elastic"
    billing: str = "per_use"
    scaling: str = "elastic"
    dedup: bool = True
    migration: str = "local"
    oracle: bool = False  # perfect length knowledge instead of the predictor
    prewarm: bool = True  # start workers a cold start ahead, so it is billed but not waited
    engine: str = "dedicated"  # generation engine settings (profiles.ENGINES)
    tp: int | None = None  # generation TP; None: the engine's (else the model's)
    shared_prompt_forward: bool = False  # learner forwards each group's prompt once
    tail_forwards: bool = False  # forward-only passes on generation GPUs freed in the tail
    score_step: bool = False  # scaling scores generation + the update that follows
    pat: bool = False  # PAT: merge a node's live workers into a higher TP in the tail

    def __post_init__(self) -> None:
        for key, allowed in CHOICES.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"PolicyConfig({self.name!r}): {key}={getattr(self, key)!r}; "
                                 f"allowed: {allowed}")
        try:
            super().__post_init__()
        except ValueError as err:
            raise ValueError(f"PolicyConfig({self.name!r}): {err}") from None

    def replace(self, **changes: Any) -> PolicyConfig:
        return dataclasses.replace(self, **changes)

    def to_record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


VERL_03 = PolicyConfig("verl-0.3", billing="reserved", scaling="static",
                       assignment="round_robin", dedup=False, migration="none", engine="verl-0.3")
VERL_TUNED = VERL_03.replace(name="verl-tuned", engine="verl-tuned")
VERL = VERL_03  # the RLHFless paper's baseline
SERVERLESS_BASE = PolicyConfig("serverless base", scaling="static", assignment="round_robin",
                               dedup=False, migration="none")
# the paper's mechanisms: dedup, assignment, scaling, cut-and-migrate (see ablations())
PAPER_MECHANISMS = PolicyConfig("rlhfless (paper's mechanisms)")
ELASTIC = PAPER_MECHANISMS.replace(name="rlhfless (ours)", pat=True, score_step=True,
                                   shared_prompt_forward=True, tail_forwards=True)
RLHFUSE = PolicyConfig("rlhfuse-like", assignment="round_robin", migration="global", tau=0.9)
ORACLE = ELASTIC.replace(name="oracle", oracle=True)


def ablations() -> list[PolicyConfig]:
    """The ablation chain on per-use billing: RLHFless's base, +dedup, +assignment, +scaling,
    +cut-and-migrate (the paper's mechanisms), then ours: +PAT, +shared-prompt forward,
    +forwards on released generation GPUs, +whole-step scoring (the full policy)."""
    base = SERVERLESS_BASE
    dedup = base.replace(name="+dedup", dedup=True)
    assign = dedup.replace(name="+assignment", assignment="length")
    scale = assign.replace(name="+scaling", scaling="elastic")
    migrate = scale.replace(name="+cut-and-migrate", migration=PAPER_MECHANISMS.migration)
    pat = migrate.replace(name="+PAT", pat=True)
    shared = pat.replace(name="+shared-prompt forward", shared_prompt_forward=True)
    tail = shared.replace(name="+forwards in the tail", tail_forwards=True)
    return [base, dedup, assign, scale, migrate, pat, shared, tail,
            tail.replace(name="+whole-step scoring", score_step=True)]


def global_cut(progress: Mapping[str, WorkerProgress], cap: int | None) -> list[Migration]:
    """RLHFuse-like consolidation: keep the fewest workers that can hold every unfinished
    sequence (those holding the most already), deal the others' sequences to them longest
    remaining first, each to the kept worker with the least predicted remaining tokens."""
    names = [n for n, p in progress.items() if p.seq_ids]
    if len(names) <= 1:
        return []
    live = np.array([len(progress[n].seq_ids) for n in names])
    need = 1 if cap is None else max(1, -(-int(live.sum()) // cap))
    if need >= len(names):
        return []
    order = np.argsort(-live, kind="stable")
    keep, move = order[:need], order[need:]
    load = np.array([progress[names[i]].remaining_tokens.sum() for i in keep])
    room = np.array([np.inf if cap is None else cap - live[i] for i in keep])
    items = [(float(progress[names[i]].remaining_tokens[j]), i, j)
             for i in move for j in range(len(progress[names[i]].seq_ids))]
    items.sort(key=lambda x: -x[0])
    moves: dict[tuple[int, int], list[int]] = {}
    for rem, i, j in items:
        k = int(np.argmin(np.where(room > 0, load, np.inf)))
        load[k] += rem
        room[k] -= 1
        moves.setdefault((int(i), int(keep[k])), []).append(j)
    plan = []
    for (i, k), idx in moves.items():
        p = progress[names[i]]
        plan.append(Migration(
            source=names[i], target=names[k], seq_ids=tuple(p.seq_ids[j] for j in idx),
            recompute_tokens=int(p.current_lengths[idx].sum()),
            completion_fraction=p.completion_fraction, stay_seconds=float("nan"),
            move_seconds=float("nan"), stay_cost_ws=float("nan"), move_cost_ws=float("nan"),
            reason=f"global cut: consolidate onto {need} worker(s)"))
    return plan


class SimPolicy:
    """The elastic policy (``ScalingPolicy``) under one simulated system's mechanisms: the
    oracle's true lengths, static scaling, a replayed assignment, a global cut."""

    def __init__(self, cfg: PolicyConfig, profile: Profile, pool: int, cap: int,
                 ctx_hint: float, max_response_tokens: int | None = None) -> None:
        self.cfg = cfg
        self.max_response_tokens = max_response_tokens
        self.pool = int(pool)
        self.cap = int(cap)
        self.engine_prefill_rate = profile.prefill_tokens_per_s  # what the simulated engine does
        kv_s = profile.kv_transfer_seconds(1.0)
        # prior: the profile's step model, its context term folded in at a typical context
        self.scaling = ScalingPolicy(cfg, ThroughputModel(
            step_intercept_s=profile.step_base_s,
            step_slope_s=profile.step_per_seq_s + profile.step_per_ctx_token_s * ctx_hint,
            prefill_tokens_per_s=profile.prefill_tokens_per_s,
            cold_start_s=profile.gen_wake_s, max_batch=self.cap),
            kv_seconds_per_token=kv_s if np.isfinite(kv_s) else None)
        self._pred: tuple[np.ndarray, np.ndarray] | None = None

    def predictions(self, batch: Batch) -> tuple[np.ndarray, np.ndarray]:
        """Predicted (mean, max) response tokens per group: the EWMA, or the truth."""
        if self.cfg.oracle:
            lengths = batch.lengths.astype(np.float64)
            return lengths.mean(axis=1), lengths.max(axis=1)
        return self.scaling.predict(batch.prompt_ids.tolist())

    def prefill_per_group(self, batch: Batch) -> np.ndarray:
        """Prompt tokens each group prefills: once (dedup) or once per sample."""
        if self.cfg.dedup:
            return np.maximum(batch.prompt_tokens - batch.shared_prefix_tokens, 0).astype(float)
        return batch.prompt_tokens.astype(np.float64) * batch.n_samples

    def plan(self, batch: Batch, keep_warm: int, rest_workers: float = 0.0) -> ScalingDecision:
        """This iteration's worker count and assignment (``ScalingPolicy.plan``); with
        ``score_step`` the rest of the step (the policy's seconds after generation, billed at
        ``rest_workers`` generation workers) is scored too."""
        mean, mx = self._pred = self.predictions(batch)
        cfg = self.cfg
        assign = None
        if cfg.assignment == "replay":
            if batch.workers is None:
                raise ValueError(f"policy {cfg.name!r}: assignment 'replay' needs a replayed "
                                 "trace (batches with logged workers)")
            n_log = int(batch.workers.max()) + 1

            def assign(pred: np.ndarray, n: int) -> list[np.ndarray]:
                return [np.flatnonzero(batch.workers == w) for w in range(n)]

            lo = hi = n_log
        else:
            hi = min(self.pool, batch.n_groups)
            lo = hi if cfg.scaling == "static" else 1
        return self.scaling.plan(
            mean, mx, batch.n_samples, self.prefill_per_group(batch), keep_warm=keep_warm,
            max_workers=hi, min_workers=lo, assign=assign,
            rest_workers=rest_workers if cfg.score_step else None)

    def remaining(self, group: np.ndarray, generated: np.ndarray,
                  true_remaining: np.ndarray) -> np.ndarray:
        """Predicted tokens still to decode for unfinished sequences: the truth (oracle), or
        ``ScalingPolicy.remaining`` (conditioned on what each has generated)."""
        if self.cfg.oracle or self._pred is None:
            return true_remaining.astype(np.float64)
        return self.scaling.remaining(self._pred[1][group], generated,
                                      self.max_response_tokens)

    def migrate(self, progress: Mapping[str, WorkerProgress]) -> list[Migration]:
        if self.cfg.migration == "local":
            return self.scaling.migrate(progress)
        if self.cfg.migration == "global":
            return global_cut(progress, self.cap)
        return []

    def observe(self, batch: Batch, runs: list[Any], after_generation_s: float) -> dict[str, Any]:
        """After an iteration: score the predictions planning used (``mape``; the rest of
        the record is ``LengthPredictor.error``), update the predictor, feed the step
        timings and prefill rates of the simulated workers (``WorkerRun``s) to the
        throughput model and the seconds after generation to the policy."""
        error = self.scaling.observe_lengths(np.repeat(batch.prompt_ids, batch.n_samples)
                                             .tolist(), batch.lengths.ravel())
        if self._pred is not None:  # score what planning used (the truth, for the oracle)
            actual = batch.lengths.mean(axis=1)
            error["mape"] = float(np.mean(np.abs(self._pred[0] - actual)
                                          / np.maximum(actual, 1.0)))
        for run in runs:
            b, s, k = run.chunks()
            if b.size:
                self.scaling.observe_decode(b, s, k)
            tokens = float(run.prefill.sum())
            if tokens > 0:
                self.scaling.observe_prefill(tokens, tokens / self.engine_prefill_rate)
        self.scaling.observe_after_generation(after_generation_s)
        return error
