"""Rebalancing the generation tail: workers that ran short of work take part of the
heaviest one's, with its KV cache or recomputed (RLHFless moves stragglers to workers with
room; here the worker that sheds keeps decoding the rest).

At a pause every worker reports its tail: per unfinished sequence the predicted remaining
tokens and the context tokens that would travel with it. Under continuous batching a worker
finishes its tail in ``StepProfile.decode_seconds`` (the measured step time at each live
batch), and the pool with its slowest worker. ``plan_split`` sheds sequences from the worker
predicted to finish last to the one predicted to finish first, one at a time, each time the
sequence whose move lowers the later of the two finishes most. A receiving worker's finish
includes landing the context it receives (``move_s`` of its context tokens: the caller's
cost of a KV transfer or a recomputation, whichever it would pick); a worker that received
is never a source afterwards and a source never a target, so nothing moves twice. It stops
when no move lowers the pool's finish, and fires when the pool finishes sooner by the
profile's medians and by each of its repeats taken alone (``StepProfile.sooner_in_repeats``,
the rule ``plan_reconfig`` fires by).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .tail_cost import StepProfile


@dataclass(frozen=True)
class Shed:
    """Sequences at ``positions`` of ``source``'s paused tail continue on ``target``."""

    source: str
    target: str
    positions: tuple[int, ...]
    context_tokens: int


@dataclass(frozen=True)
class SplitChoice:
    fire: bool
    moves: tuple[Shed, ...]  # empty when staying
    stay_s: float  # predicted seconds until the pool is done as is
    split_s: float  # ... after the moves, landing included
    finish_s: dict[str, float]  # per worker, after the moves
    reason: str

    def to_record(self) -> dict:
        return {"fire": self.fire, "stay_s": self.stay_s, "split_s": self.split_s,
                "finish_s": self.finish_s, "reason": self.reason,
                "moves": [m.__dict__ | {"positions": list(m.positions)} for m in self.moves]}


class _Pool:
    """Who decodes what while a plan is built: per worker its predicted remaining tokens
    (own sequences by position, received ones) and the context it receives."""

    def __init__(self, tails: Mapping[str, Sequence[float]], threads: Mapping[str, int],
                 profile: StepProfile, move_s: Callable[[int], float]) -> None:
        self.threads, self.profile, self.move_s = threads, profile, move_s
        self.own = {w: dict(enumerate(map(float, tails.get(w, ())))) for w in threads}
        self.received: dict[str, list[float]] = {w: [] for w in threads}
        self.context = dict.fromkeys(threads, 0)

    def finish(self, w: str, drop: int | None = None, add: tuple[float, int] | None = None
               ) -> float:
        """``w``'s predicted finish; without its own position ``drop``, or with one more
        sequence ``add`` = (remaining tokens, context tokens) received."""
        rem = [r for p, r in self.own[w].items() if p != drop] + self.received[w]
        ctx = self.context[w]
        if add is not None:
            rem, ctx = rem + [add[0]], ctx + add[1]
        landing = self.move_s(ctx) if ctx else 0.0
        return landing + self.profile.decode_seconds(rem, self.threads[w]) if rem else 0.0


def plan_split(tails: Mapping[str, Sequence[float]], context: Mapping[str, Sequence[int]],
               threads: Mapping[str, int], profile: StepProfile,
               move_s: Callable[[int], float]) -> SplitChoice:
    """Shed sequences from the workers predicted to finish last to those predicted to finish
    first; pure. ``tails``: per worker, the predicted remaining tokens of its paused
    sequences by batch position (a worker with none may be listed in ``threads`` alone: it
    can receive); ``context``: their context tokens (prompt + generated); ``move_s``:
    predicted seconds to land that many context tokens on a worker. See the module
    docstring."""
    pool = _Pool(tails, threads, profile, move_s)
    finish = {w: pool.finish(w) for w in threads}
    stay_s = max(finish.values(), default=0.0)
    sources: set[str] = set()
    targets: set[str] = set()
    moved: dict[tuple[str, str], list[int]] = {}
    while True:
        src = max(finish, key=finish.get)
        dst = min((w for w in finish if w not in sources), key=finish.get, default=src)
        if src in targets or src == dst or not pool.own[src]:
            break
        best, best_s = None, max(finish[src], finish[dst])
        for pos, rem in pool.own[src].items():
            after = max(pool.finish(src, drop=pos),
                        pool.finish(dst, add=(rem, int(context[src][pos]))))
            if after < best_s - 1e-9:
                best, best_s = pos, after
        if best is None:
            break
        rem = pool.own[src].pop(best)
        pool.received[dst].append(rem)
        pool.context[dst] += int(context[src][best])
        moved.setdefault((src, dst), []).append(best)
        sources.add(src)
        targets.add(dst)
        finish[src], finish[dst] = pool.finish(src), pool.finish(dst)
    split_s = max(finish.values(), default=0.0)

    def timed(p: StepProfile) -> tuple[float, float]:
        """Seconds staying and split (landing included) by the profile ``p``."""
        again = _Pool(tails, threads, p, move_s)
        stay = max(again.finish(w) for w in threads)
        for (s, d), positions in moved.items():
            for pos in positions:
                again.received[d].append(again.own[s].pop(pos))
                again.context[d] += int(context[s][pos])
        return stay, max(again.finish(w) for w in threads)

    sooner, repeats = profile.sooner_in_repeats(timed), len(profile.repeats())
    fire = bool(moved) and split_s < stay_s and sooner == repeats
    moves = tuple(Shed(s, d, tuple(sorted(p)), sum(int(context[s][i]) for i in p))
                  for (s, d), p in moved.items())
    n = sum(len(m.positions) for m in moves)
    why = (f"shed {n} sequence(s) in {len(moves)} move(s): pool done in {split_s:.2f} s "
           f"against {stay_s:.2f} s staying (medians); sooner in {sooner} of {repeats} "
           "repeats of the profile")
    return SplitChoice(fire, moves if fire else (), float(stay_s),
                       float(split_s if fire else stay_s),
                       {w: round(float(f), 4) for w, f in finish.items()},
                       ("split: " if fire else "stay: ") + why)
