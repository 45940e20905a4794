"""Cut-and-migrate of a generation tail inside an iteration (RLHFless, with PAT's trade-off).

Generation runs in chunks. Between chunks each worker reports its progress; a worker whose
live batch has shrunk to a *tail* -- few sequences left (at most ``tail_batch``: the batch
below which the fixed part of a decode step, the weights read, is over ``TAIL_FIXED_SHARE``
of it, so that the step mostly reads the weights for few sequences) -- may have its tail
cut and continued on other workers, and is then released. ``plan_migration`` plans every
such tail of the fleet in one pass, jointly: tails are visited shortest predicted remaining
time first, every move updates its targets' predicted load (live sequences, longest and
total remaining tokens, context to receive), so a later tail sees what the earlier ones
already sent and several tails never pile onto one target beyond its free slots or its
time. For each tail it scores

- *stay*: nothing moves;
- *move to one worker*, for every worker with room for the whole tail (the RLHFless case:
  consolidate a tail into a worker that runs longer anyway, release the source: cheaper);
- *spread over the m least-loaded workers*, m = 2, 4, .. ``MAX_SPREAD`` (a big tail
  decoded in several smaller batches: faster), dealt longest-first to whichever target would
  then finish first.

Every option has a time (when the last of all listed workers finishes) and a cost (the sum of
their remaining busy seconds, i.e. worker-seconds still to bill). An option whose time is
later than staying is never taken (a move must not trade the step's speed for cost); among
the others the score of ``scaling.py``, ``lam * T / min T + (1 - lam) * C / min C``, picks,
and a move must score below staying. A worker that receives sequences is not a source later
and a source that moved is not a target, so no sequence moves twice. The predicted remaining
tokens of each sequence are the caller's, conditioned on what it has generated
(``predictor.remaining_tokens``).

A moved sequence's context reaches its target either as its KV cache (shipped at
``kv_seconds_per_token``) or by recomputation (a prefill at the model's rate), whichever costs
less per token; ``Migration.kv`` says which.

Simplifications: targets are warm; the time to cut and ship token ids is ignored; step time
is the throughput model's, on every worker alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .throughput import ThroughputModel

MAX_SPREAD = 8  # most targets one source's tail is spread over
# a worker is in its tail once the weights read is this share of its decode step; measured
# in the simulator's paper settings: 2/3 (b = a / 2c) saves more GPU-s in both than 1/2
# (b = a / c) and 0.8 (bench/simulate.py, tail-trigger sweep in the README)
TAIL_FIXED_SHARE = 2.0 / 3.0


@dataclass(frozen=True, eq=False)
class WorkerProgress:
    """What one generation worker reports between chunks.

    ``seq_ids``, ``current_lengths`` (prompt + generated tokens so far) and
    ``remaining_tokens`` (predicted tokens still to decode) describe its *unfinished*
    sequences, queued ones included; ``n_finished + len(seq_ids) == n_assigned``. ``busy``
    says whether it is running a generation chunk (one that is not busy but still holds
    sequences is paused between chunks: its tail can be cut); a worker with nothing
    assigned is idle.
    """

    n_assigned: int
    n_finished: int
    seq_ids: Sequence[str] = ()
    current_lengths: np.ndarray | Sequence[int] = ()
    remaining_tokens: np.ndarray | Sequence[float] = ()
    busy: bool = True

    def __post_init__(self) -> None:
        cur = np.asarray(self.current_lengths, dtype=np.float64).reshape(-1)
        rem = np.asarray(self.remaining_tokens, dtype=np.float64).reshape(-1)
        ids = tuple(str(s) for s in self.seq_ids)
        if not (len(ids) == cur.size == rem.size):
            raise ValueError(
                f"WorkerProgress: {len(ids)} seq_ids, {cur.size} current_lengths and "
                f"{rem.size} remaining_tokens; give one of each per unfinished sequence"
            )
        if self.n_finished < 0 or self.n_finished + len(ids) != self.n_assigned:
            raise ValueError(
                f"WorkerProgress: n_finished={self.n_finished} + {len(ids)} unfinished != "
                f"n_assigned={self.n_assigned}; every assigned sequence is finished or listed"
            )
        for name, arr in (("current_lengths", cur), ("remaining_tokens", rem)):
            if arr.size and (not np.all(np.isfinite(arr)) or arr.min() < 0):
                raise ValueError(f"WorkerProgress: {name} must be finite and >= 0, got {arr}")
        object.__setattr__(self, "seq_ids", ids)
        object.__setattr__(self, "current_lengths", cur)
        object.__setattr__(self, "remaining_tokens", rem)

    @property
    def completion_fraction(self) -> float:
        """Finished / assigned; 1.0 for a worker with nothing assigned."""
        return 1.0 if self.n_assigned == 0 else self.n_finished / self.n_assigned


@dataclass(frozen=True)
class Migration:
    """One planned move of sequences from ``source`` to ``target``."""

    source: str
    target: str
    seq_ids: tuple[str, ...]
    recompute_tokens: int  # prefix tokens the target prefills again
    completion_fraction: float  # of the source when the plan was made
    stay_seconds: float  # predicted time if the source's tail stays
    move_seconds: float  # predicted time with the chosen move
    stay_cost_ws: float
    move_cost_ws: float
    reason: str
    kv: str = "recompute"  # how the context reaches the target: "recompute" or "transfer"

    def to_record(self) -> dict[str, Any]:
        """JSON-able record for the run directory's decision log."""
        record = dict(self.__dict__)
        record["seq_ids"] = list(self.seq_ids)
        return record


class _Option(NamedTuple):
    """One way to place a tail: predicted time and cost of the whole fleet, the targets,
    the tail's positions per target and each target's new predicted finish."""

    seconds: float
    cost: float
    targets: np.ndarray
    picks: list[list[int]]
    new_finish: np.ndarray


class _Fleet:
    """Remaining work of every worker while a plan is built; index i is ``names[i]``."""

    def __init__(self, progress: Mapping[str, WorkerProgress], model: ThroughputModel,
                 move_s_per_token: float) -> None:
        self.model = model
        self.move_s_per_token = move_s_per_token  # seconds per received context token
        self.names = list(progress)
        rems = [p.remaining_tokens for p in progress.values()]
        self.mx = np.array([r.max(initial=0.0) for r in rems])  # longest remaining tail
        self.tot = np.array([r.sum() for r in rems])  # remaining decode tokens
        self.pre = np.zeros(len(rems))  # prefix tokens received, to recompute
        self.live = np.array([r.size for r in rems], dtype=np.int64)
        self.busy = np.array([p.busy for p in progress.values()])
        self.sink = np.zeros(len(rems), dtype=bool)  # received sequences: never a source
        self.emptied = np.zeros(len(rems), dtype=bool)  # moved its tail: never a target
        self.finish = self.seconds(self.mx, self.tot, self.pre, self.live)

    def seconds(
        self, mx: np.ndarray, tot: np.ndarray, pre: np.ndarray, live: np.ndarray
    ) -> np.ndarray:
        """Seconds until a worker with these totals is done (0 when it has nothing)."""
        t = self.move_s_per_token * pre + self.model.decode_seconds(mx, tot)
        return np.where((live > 0) | (pre > 0), t, 0.0)

    def max_without(self, exclude: Sequence[int]) -> float:
        f = self.finish.copy()
        f[list(exclude)] = 0.0
        return float(f.max(initial=0.0))

    def options(self, src: int, rem: np.ndarray, cur: np.ndarray) -> list[_Option]:
        """Every placement of ``src``'s tail: on one worker with room, or spread."""
        cap = self.model.max_batch
        eligible = ~self.emptied
        eligible[src] = False
        total = float(self.finish.sum())
        out: list[_Option] = []
        # one target: every eligible worker with room for the whole tail, all at once
        one = np.flatnonzero(eligible & (True if cap is None else self.live + rem.size <= cap))
        if one.size:
            new = self.seconds(
                np.maximum(self.mx[one], rem.max()), self.tot[one] + rem.sum(),
                self.pre[one] + cur.sum(), self.live[one] + rem.size,
            )
            rest = np.zeros(one.size)  # max finish over the others: first of the top 3 not used
            for top in np.argsort(-self.finish)[:3][::-1]:
                rest = np.where((top != src) & (top != one), self.finish[top], rest)
            whole = [list(range(rem.size))]
            for j, n_t, r in zip(one.tolist(), new.tolist(), rest.tolist(), strict=True):
                cost = total - self.finish[src] - self.finish[j] + n_t
                out.append(_Option(max(n_t, r), float(cost), np.array([j]), whole,
                                   np.array([n_t])))
        # spread over the m least-loaded workers with a free slot
        room = np.flatnonzero(eligible & (True if cap is None else self.live < cap))
        room = room[np.lexsort((self.busy[room], self.finish[room]))][:MAX_SPREAD]
        m = 2
        while m <= min(room.size, rem.size):
            targets, m = room[:m], m * 2
            spread = _spread(self, targets, rem, cur)
            if spread is None:
                continue
            picks, new = spread
            t = max(float(new.max()), self.max_without([src, *targets.tolist()]))
            c = total - self.finish[src] - self.finish[targets].sum() + new.sum()
            out.append(_Option(t, float(c), targets, picks, new))
        return out

    def move(self, src: int, rem: np.ndarray, cur: np.ndarray, option: _Option) -> None:
        """Book ``option``: its targets take their picks, the source is emptied."""
        for tgt, idx, n_t in zip(option.targets.tolist(), option.picks, option.new_finish,
                                 strict=True):
            if not idx:
                continue
            self.mx[tgt] = max(self.mx[tgt], rem[idx].max())
            self.tot[tgt] += rem[idx].sum()
            self.pre[tgt] += cur[idx].sum()
            self.live[tgt] += len(idx)
            self.finish[tgt] = n_t
            self.sink[tgt] = True
        self.mx[src] = self.tot[src] = self.pre[src] = self.finish[src] = 0.0
        self.live[src] = 0
        self.emptied[src] = True


def _spread(
    fleet: _Fleet, targets: np.ndarray, rem: np.ndarray, cur: np.ndarray
) -> tuple[list[list[int]], np.ndarray] | None:
    """Deal a tail longest-first, each sequence to the target that would then finish first.

    Returns the sequence positions per target and each target's new finish seconds, or None
    when the targets' free slots cannot hold the tail."""
    a, c = fleet.model.step_intercept_s, fleet.model.step_slope_s
    per_token, cap = fleet.move_s_per_token, fleet.model.max_batch
    mx, tot = fleet.mx[targets].tolist(), fleet.tot[targets].tolist()
    pre, live = fleet.pre[targets].tolist(), fleet.live[targets].tolist()
    picks: list[list[int]] = [[] for _ in targets]
    for j in np.argsort(-rem, kind="stable").tolist():
        best, best_t = -1, np.inf
        for i in range(len(targets)):
            if cap is not None and live[i] >= cap:
                continue
            m, t_tok = max(mx[i], rem[j]), tot[i] + rem[j]
            steps = m if cap is None else max(m, t_tok / cap)
            t = (pre[i] + cur[j]) * per_token + a * steps + c * t_tok
            if t < best_t:
                best, best_t = i, t
        if best < 0:
            return None
        picks[best].append(j)
        mx[best], tot[best] = max(mx[best], rem[j]), tot[best] + rem[j]
        pre[best] += cur[j]
        live[best] += 1
    new = fleet.seconds(np.array(mx), np.array(tot), np.array(pre), np.array(live))
    return picks, new


def _score(t: float, c: float, t_min: float, c_min: float, lam: float) -> float:
    """``lam * t / t_min + (1 - lam) * c / c_min``, a zero minimum counting as ratio 1."""
    tn = t / t_min if t_min > 0 else 1.0
    cn = c / c_min if c_min > 0 else 1.0
    return lam * tn + (1.0 - lam) * cn


def tail_batch(model: ThroughputModel) -> float:
    """Live sequences at or below which a worker is in its tail: the batch at which the
    fixed part of a decode step (the weights read) is ``TAIL_FIXED_SHARE`` of the step,
    ``a / (a + c b) = share``, so that below it the step mostly reads the weights for few
    sequences; never above the engine cap (inf: no slope and no cap)."""
    a, c = model.step_intercept_s, model.step_slope_s
    b = np.inf if c <= 0 else a * (1.0 - TAIL_FIXED_SHARE) / (TAIL_FIXED_SHARE * c)
    return float(b if model.max_batch is None else min(b, model.max_batch))


def plan_migration(
    worker_progress: Mapping[str, WorkerProgress],
    tau: float | None,
    model: ThroughputModel,
    *,
    lambda_cost: float = 0.5,
    kv_seconds_per_token: float | None = None,
) -> list[Migration]:
    """Plan which tails to cut and where to continue them, jointly over the fleet; pure.

    Called with the progress of every generation worker (idle ones included: they are
    candidate targets). Sources are the workers in their tail: paused (not ``busy``: a
    worker running a chunk cannot be cut) with at least one and at most ``tail_batch``
    unfinished sequences, and, when ``tau`` is a number, completion ``>= tau`` (a count
    gate for callers that want one; the elastic policy passes None). A source's whole tail
    moves or none of it does. Times and costs are over all listed workers: time is the last
    one to finish, cost the sum of their remaining busy seconds; a move is taken only when
    the predicted time, the move included, is no later than staying and its score is lower
    (see the module docstring). ``kv_seconds_per_token``: the time to ship one context
    token's KV cache between workers (None: no transfer path, so recomputation). Returns
    one ``Migration`` per (source, target) pair in planning order; an empty list means
    everything stays.
    """
    if tau is not None and not 0.0 < tau <= 1.0:
        raise ValueError(f"plan_migration: tau={tau!r}; allowed: None or 0 < tau <= 1")
    if not 0.0 <= lambda_cost <= 1.0:
        raise ValueError(f"plan_migration: lambda_cost={lambda_cost!r}; allowed: [0, 1]")
    recompute_s = 1.0 / model.prefill_tokens_per_s
    transfer = kv_seconds_per_token is not None and kv_seconds_per_token < recompute_s
    fleet = _Fleet(worker_progress, model,
                   kv_seconds_per_token if transfer else recompute_s)
    progress = list(worker_progress.values())
    few = tail_batch(model)
    sources = [i for i, p in enumerate(progress)
               if not p.busy and 0 < len(p.seq_ids) <= few
               and (tau is None or p.completion_fraction >= tau)]
    sources.sort(key=lambda i: (fleet.finish[i], fleet.names[i]))
    plan: list[Migration] = []
    for src in sources:
        if fleet.sink[src]:
            continue
        prog = progress[src]
        rem, cur = prog.remaining_tokens, prog.current_lengths
        stay_t, stay_c = float(fleet.finish.max()), float(fleet.finish.sum())
        options = [o for o in fleet.options(src, rem, cur)
                   if o.seconds <= stay_t * (1.0 + 1e-12)]  # never later than staying
        if not options:
            continue
        t_min = min(stay_t, *(o.seconds for o in options))
        c_min = min(stay_c, *(o.cost for o in options))
        scores = [_score(o.seconds, o.cost, t_min, c_min, lambda_cost) for o in options]
        best = int(np.argmin(scores))
        stay_score = _score(stay_t, stay_c, t_min, c_min, lambda_cost)
        if scores[best] >= stay_score:
            continue
        option = options[best]
        why = (f"tail of {rem.size} sequence(s) <= {few:.0f}; {option.targets.size} "
               f"target(s): predicted {option.seconds:.2f} s <= stay {stay_t:.2f} s, score "
               f"{scores[best]:.4f} < stay {stay_score:.4f} at lambda {lambda_cost:.2f}")
        for tgt, idx in zip(option.targets.tolist(), option.picks, strict=True):
            if idx:
                plan.append(Migration(
                    source=fleet.names[src], target=fleet.names[tgt],
                    seq_ids=tuple(prog.seq_ids[i] for i in idx),
                    recompute_tokens=int(cur[idx].sum()),
                    completion_fraction=prog.completion_fraction,
                    stay_seconds=stay_t, move_seconds=option.seconds,
                    stay_cost_ws=stay_c, move_cost_ws=option.cost, reason=why,
                    kv="transfer" if transfer else "recompute"))
        fleet.move(src, rem, cur, option)
    return plan
