"""Costs of acting on the generation tail: move a tail's KV or recompute it; reconfigure.

Two pure decisions, both from the run's own timings:

- ``choose_kv_path``: a tail moving to another worker gets its context there either as its
  KV cache (``TransferModel``: ``latency + bytes / bandwidth``, least squares over the
  moves seen so far, which include Dask's scheduling and the worker-to-worker fetch) or by
  recomputation (a prefill at the rate ``ThroughputModel`` measured); the cheaper wins.
  ``KvCosts`` holds those models for a caller and learns each move's actual time;
- ``plan_reconfig`` (PAT on CPU): the live workers each decode their own tail with
  ``threads`` torch threads; or one worker takes every tail and decodes it with all their
  threads, the others released. ``StepProfile`` (decode step seconds by batch x threads,
  measured on the machine at start) times both; it fires only when the predicted gain
  exceeds the reconfiguration's own cost (moving the other tails' context), by the medians
  and by every repeat of the profile taken alone.

Under continuous batching a worker whose sequences have ``r_i`` tokens left runs
``max r_i`` steps, the live batch at step ``s`` being ``#{i: r_i >= s}``; the plan sums
the measured step time at each of those batches (interpolated between measured batch
sizes), not a line fitted through them: a step profile need not be linear in the batch,
and a fit's slope can credit threads with a per-sequence speedup no measured point shows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from .throughput import ThroughputModel


class TransferModel:
    """Seconds to move a KV cache of ``b`` bytes: ``latency_s + b / bytes_per_s``, fitted to
    observed moves (priors until two of different sizes were seen)."""

    def __init__(self, prior_latency_s: float = 0.05, prior_bytes_per_s: float = 2e8,
                 window: int = 256) -> None:
        if prior_latency_s < 0 or prior_bytes_per_s <= 0 or window < 2:
            raise ValueError("TransferModel: latency >= 0, bandwidth > 0, window >= 2")
        self.latency_s, self.bytes_per_s = prior_latency_s, prior_bytes_per_s
        self.window = window
        self._obs: list[tuple[float, float]] = []

    def observe(self, nbytes: float, seconds: float) -> None:
        if not (np.isfinite(nbytes) and np.isfinite(seconds) and nbytes >= 0 and seconds >= 0):
            raise ValueError(f"TransferModel.observe: bytes={nbytes}, seconds={seconds}")
        self._obs = (self._obs + [(float(nbytes), float(seconds))])[-self.window :]
        x, y = np.array(self._obs).T
        if x.size < 2 or np.ptp(x) <= 0:
            self.latency_s = max(0.0, float(y.mean() - x.mean() / self.bytes_per_s))
            return
        slope, intercept = np.polyfit(x, y, 1)
        if slope > 0:
            self.bytes_per_s = float(1.0 / slope)
            self.latency_s = max(0.0, float(intercept))
        else:  # no size effect measurable: all latency
            self.latency_s = float(y.mean())

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + float(nbytes) / self.bytes_per_s

    def to_record(self) -> dict:
        return {"latency_s": self.latency_s, "bytes_per_s": self.bytes_per_s,
                "n_obs": len(self._obs)}

    def state_dict(self) -> dict:
        return {"latency_s": self.latency_s, "bytes_per_s": self.bytes_per_s,
                "observations": [list(o) for o in self._obs]}

    def load_state_dict(self, state: Mapping) -> None:
        self.latency_s = float(state["latency_s"])
        self.bytes_per_s = float(state["bytes_per_s"])
        self._obs = [(float(b), float(s)) for b, s in state["observations"]][-self.window :]


@dataclass(frozen=True)
class KvChoice:
    path: str  # "transfer" | "recompute"
    transfer_s: float  # predicted
    recompute_s: float  # predicted

    @property
    def predicted_s(self) -> float:
        return self.transfer_s if self.path == "transfer" else self.recompute_s


def choose_kv_path(context_tokens: int, kv_bytes: int, transfer: TransferModel,
                   throughput: ThroughputModel) -> KvChoice:
    """Transfer the KV of ``context_tokens`` (``kv_bytes``) or recompute it, whichever the
    fitted models predict faster; pure."""
    t = transfer.seconds(kv_bytes)
    r = float(throughput.prefill_seconds(context_tokens))
    return KvChoice("transfer" if t <= r else "recompute", float(t), r)


class KvCosts:
    """The transfer-vs-recompute decision and what it learns, for whoever moves tails (the
    elastic loop's policy, ``bench/tail_harness.py``): the ``TransferModel``, the KV bytes per
    context token (the last transfer's, or a prior from the model's shape) and the prefill
    rate of ``throughput`` (shared with the policy's throughput model)."""

    def __init__(self, throughput: ThroughputModel, transfer: TransferModel | None = None,
                 kv_bytes_per_token: float | None = None) -> None:
        self.throughput = throughput
        self.transfer = transfer if transfer is not None else TransferModel()
        self.kv_bytes_per_token = kv_bytes_per_token  # None: unknown (no prior, no transfer)

    def choose(self, context_tokens: int) -> KvChoice:
        """``choose_kv_path`` for a move of ``context_tokens`` (bytes unknown: latency only)."""
        nbytes = int(context_tokens * (self.kv_bytes_per_token or 0.0))
        return choose_kv_path(context_tokens, nbytes, self.transfer, self.throughput)

    def seconds_per_token(self) -> float | None:
        """Marginal seconds to ship one context token's KV (None while the bytes are
        unknown): what cut-and-migrate planning charges per moved token."""
        if self.kv_bytes_per_token is None:
            return None
        return self.kv_bytes_per_token / self.transfer.bytes_per_s

    def observe(self, path: str, context_tokens: int, nbytes: int, seconds: float,
                learn_prefill: bool = True) -> None:
        """A move's actual ``seconds``: a transfer fits the transfer model (and the bytes per
        token), a recomputation the prefill rate (unless ``learn_prefill`` is False: the
        caller feeds that prefill to the throughput model itself)."""
        if path == "transfer":
            self.transfer.observe(nbytes, seconds)
            if context_tokens > 0 and nbytes > 0:
                self.kv_bytes_per_token = nbytes / context_tokens
        elif path == "recompute":
            if learn_prefill and context_tokens > 0 and seconds > 0:
                self.throughput.observe_prefill(context_tokens, seconds)
        else:
            raise ValueError(f"KvCosts.observe: path={path!r}; allowed: transfer, recompute")

    def state_dict(self) -> dict:
        return {"transfer": self.transfer.state_dict(),
                "kv_bytes_per_token": self.kv_bytes_per_token}

    def load_state_dict(self, state: Mapping) -> None:
        self.transfer.load_state_dict(state["transfer"])
        kv = state.get("kv_bytes_per_token")
        self.kv_bytes_per_token = None if kv is None else float(kv)


class StepProfile:
    """Decode step seconds by live batch and torch threads, measured: several samples per
    (batch, threads). A step's seconds at a batch is the samples' median at a measured batch,
    linear between the two measured batches around it, and past the largest measured batch
    continues the last measured segment's slope (never falling; ``largest_batch`` says where
    that begins, so a caller can say it extrapolated). ``noise`` is the largest relative
    half-range of a point's samples (how far one sample can be off); ``repeats`` the
    profiles of one sample per point, the ``i``-th of each (a measurement that cycles over
    every point per repeat makes each a whole profile taken at one time), which a decision
    must hold under each of."""

    def __init__(self, measured: Mapping[tuple[int, int], Sequence[float]]) -> None:
        if not measured or any(len(v) == 0 or min(v) <= 0 for v in measured.values()):
            raise ValueError("StepProfile: every (batch, threads) needs positive samples")
        self.measured = {k: [float(x) for x in v] for k, v in measured.items()}
        by_threads: dict[int, list[tuple[int, float]]] = {}
        for (batch, threads), samples in self.measured.items():
            by_threads.setdefault(int(threads), []).append((int(batch), float(np.median(samples))))
        if any(len({b for b, _ in v}) < 2 for v in by_threads.values()):
            raise ValueError("StepProfile: measure at least two batch sizes per thread count")
        self.points: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for threads, points in by_threads.items():
            self.points[threads] = tuple(np.array(sorted(points), dtype=np.float64).T)
        self.noise = max((max(v) - min(v)) / (2 * float(np.median(v)))
                         for v in self.measured.values())
        self.scale = 1.0  # measured steps / profiled ones since (``observe``), every point

    def observe(self, batch: float, threads: int, step_s: float, alpha: float = 0.5) -> None:
        """A decode loop's own mean step (``step_s`` at mean live ``batch``, ``threads``):
        every point is rescaled towards it (an EWMA of measured / profiled), so the profile
        follows the machine as the run goes on while keeping its measured shape."""
        if threads not in self.points or not (step_s > 0 and batch > 0):
            return
        ratio = step_s / float(self.step_seconds(batch, threads) / self.scale)
        self.scale = alpha * ratio + (1.0 - alpha) * self.scale

    @property
    def threads(self) -> list[int]:
        return sorted(self.points)

    def repeats(self) -> list[StepProfile]:
        """One profile per repeat: the ``i``-th sample of every point."""
        n = min(len(v) for v in self.measured.values())
        out = [StepProfile({k: [v[i]] for k, v in self.measured.items()}) for i in range(n)]
        for p in out:
            p.scale = self.scale
        return out

    def sooner_in_repeats(self, finish: Callable[[StepProfile], tuple[float, float]]) -> int:
        """In how many of ``repeats()`` a change finishes sooner than staying; ``finish(p)``:
        (staying, changed) seconds timed by the profile ``p``. A decision fires only when
        the medians and every repeat agree: with 5 repeats, a gain that is not there passes
        all five about once in 32."""
        return sum(changed < stay for stay, changed in map(finish, self.repeats()))

    def largest_batch(self, threads: int) -> int:
        """The largest batch measured at ``threads``: beyond it step times are extrapolated."""
        return int(self.points[threads][0][-1])

    def step_seconds(self, batch: ArrayLike, threads: int) -> np.ndarray:
        """Seconds of one decode step of ``batch`` live sequences on ``threads`` threads."""
        b, s = self.points[threads]
        x = np.asarray(batch, dtype=np.float64)
        slope = max(0.0, float((s[-1] - s[-2]) / (b[-1] - b[-2])))
        return self.scale * np.where(x > b[-1], s[-1] + slope * (x - b[-1]),
                                     np.interp(x, b, s))

    def decode_seconds(self, remaining: Sequence[float], threads: int, workers: int = 1
                       ) -> float:
        """Seconds to decode sequences with ``remaining`` tokens left, all in one batch: the
        ``k`` longest are live for ``r_(k) - r_(k+1)`` steps (``r`` descending), each at the
        step time of batch ``k``; or spread evenly over ``workers`` stepping together (batch
        ``ceil(k / workers)`` on each)."""
        rem = np.sort(np.asarray(remaining, dtype=np.float64))[::-1]
        if rem.size == 0:
            return 0.0
        steps = rem - np.append(rem[1:], 0.0)
        batch = np.ceil(np.arange(1, rem.size + 1) / workers)
        return float(steps @ self.step_seconds(batch, threads))

    def speedup(self, batch: int, threads: int, base: int = 1) -> float:
        return float(self.step_seconds(batch, base) / self.step_seconds(batch, threads))

    def consolidation_speedup(self, batch: int, workers: int) -> float:
        """Per step, how much sooner one worker with the threads of ``workers`` one-thread
        workers decodes all their tails of ``batch`` sequences each (one batch of
        ``workers * batch``) than they do, each its own at once: even tails' consolidation
        pays, before any move cost, where this exceeds 1 by the medians and every repeat."""
        return float(self.step_seconds(batch, 1) / self.step_seconds(workers * batch, workers))

    def to_record(self) -> dict:
        return {"noise": self.noise, "scale": self.scale,
                "median_s": {f"{b}x{t}": float(np.median(v))
                             for (b, t), v in self.measured.items()},
                "half_range": {f"{b}x{t}": (max(v) - min(v)) / (2 * float(np.median(v)))
                               for (b, t), v in self.measured.items()},
                "samples": len(next(iter(self.measured.values())))}


@dataclass(frozen=True)
class ReconfigChoice:
    fire: bool
    target: str  # the worker that keeps every tail ("" when staying)
    threads: int  # its torch threads after the reconfiguration
    stay_s: float  # predicted seconds to finish as is
    move_s: float  # predicted seconds after reconfiguring, overhead included
    overhead_s: float
    stay_core_s: float  # predicted core-seconds (threads x seconds) still to use
    move_core_s: float
    reason: str

    def to_record(self) -> dict:
        return dict(self.__dict__)


def plan_reconfig(tails: Mapping[str, Sequence[float]], threads: Mapping[str, int],
                  profile: StepProfile, overhead_s: Mapping[str, float]) -> ReconfigChoice:
    """Stay, or consolidate every live worker's tail onto one with all their threads; pure.

    ``tails``: per live worker, the predicted remaining tokens of its sequences;
    ``overhead_s``: per candidate target, the seconds to bring the other tails to it
    (``choose_kv_path`` of each). Both sides are timed by ``StepProfile.decode_seconds``
    (the measured step times at the batches the tails run at; the reason names any batch
    beyond the largest measured one). Fires when the consolidated finish, overhead included,
    is sooner than staying by the profile's medians and by each of its repeats taken alone
    (``StepProfile.sooner_in_repeats``): the predicted gain exceeds the reconfiguration
    cost, and no single measurement of the profile says otherwise. Core-seconds of both are
    recorded (the released workers stop billing at once).
    """
    live = {w: np.asarray(r, dtype=np.float64) for w, r in tails.items() if len(r)}
    each = {w: profile.decode_seconds(r, threads[w]) for w, r in live.items()}
    stay_s = max(each.values(), default=0.0)
    stay_cs = float(sum(s * threads[w] for w, s in each.items()))
    total = sum(threads[w] for w in live)
    if len(live) < 2 or total not in profile.points:
        return ReconfigChoice(False, "", 0, stay_s, stay_s, 0.0, stay_cs, stay_cs,
                              f"{len(live)} live worker(s), {total} threads unprofiled: stay")
    every = np.concatenate(list(live.values()))
    target = min(live, key=lambda w: overhead_s[w])

    def finish(p: StepProfile) -> tuple[float, float]:
        """Seconds staying and consolidated (overhead included) by the profile ``p``."""
        stay = max(p.decode_seconds(r, threads[w]) for w, r in live.items())
        return stay, overhead_s[target] + p.decode_seconds(every, total)

    wide_s = profile.decode_seconds(every, total)
    move_s = overhead_s[target] + wide_s
    stay_s, move_s, move_cs = float(stay_s), float(move_s), float(move_s * total)
    sooner, repeats = profile.sooner_in_repeats(finish), len(profile.repeats())
    fire = move_s < stay_s and sooner == repeats
    batches = [(r.size, threads[w]) for w, r in live.items()] + [(every.size, total)]
    beyond = [f"{n} on {t} thread(s), largest measured {profile.largest_batch(t)}"
              for n, t in batches if n > profile.largest_batch(t)]
    why = (f"{every.size} sequences on {len(live)} workers: stay {stay_s:.2f} s / "
           f"{stay_cs:.2f} core-s; one worker x {total} threads {wide_s:.2f} s + overhead "
           f"{overhead_s[target]:.2f} s = {move_s:.2f} s (medians); consolidated sooner in "
           f"{sooner} of {repeats} repeats of the profile"
           + (f"; extrapolated batch {', '.join(beyond)}" if beyond else ""))
    return ReconfigChoice(fire, target if fire else "", total if fire else 0, stay_s, move_s,
                          float(overhead_s[target]), stay_cs, move_cs,
                          ("consolidate: " if fire else "stay: ") + why)


def latency_bound(profile: StepProfile, lengths: Mapping[str, Sequence[int]]) -> dict:
    """The decode seconds of a batch statically and at best, from the measured step times.
    ``lengths``: per worker (one thread each), the response tokens of its sequences.
    Statically each worker decodes its own (``decode_seconds``) and the slowest sets the
    latency. ``balanced_s``: every step's live sequences spread evenly over the ``W``
    workers (``decode_seconds(..., workers=W)``), what a perfect, free rebalancing after
    every step decodes in: with step times that never fall as the batch grows, no placement
    of a step's sequences has a cheaper slowest worker: it bounds moves between one-thread
    workers, not a change of threads (a consolidated worker with every thread can beat it
    where two one-thread workers slow each other down). Nothing decodes the longest
    response faster than alone at its best thread count (``chain_s``)."""
    lens = {w: np.asarray(v, dtype=np.float64) for w, v in lengths.items() if len(v)}
    if not lens:
        raise ValueError("latency_bound: no sequences")
    every = np.concatenate(list(lens.values()))
    static_s = max(profile.decode_seconds(v, 1) for v in lens.values())
    balanced_s = profile.decode_seconds(every, 1, workers=len(lengths))
    chain_s = every.max() * min(float(profile.step_seconds(1, t)) for t in profile.threads)
    return {"static_s": float(static_s), "balanced_s": float(balanced_s),
            "chain_s": float(chain_s), "longest": int(every.max()), "tokens": int(every.sum())}
