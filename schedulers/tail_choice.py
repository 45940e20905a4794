"""The tail decision of an elastic iteration: stay, move, split or reconfigure; pure.

When the first generation worker reaches completion ``tau`` the live runtime pauses every
other one (a Dask ``Event``), so the policy sees the whole pool's tails at once:
per worker, the predicted remaining tokens and the context of each paused sequence, and the
workers that already finished (idle). ``choose_tail`` times every action the engine
supports from the run's measured decode step profile (``tail_cost.StepProfile``) and the
cost of landing a moved context (``move_s``: a KV transfer or a recomputation, whichever
the fitted models say is faster), and takes the one that finishes the pool soonest:

- *stay*: every worker resumes its own tail;
- *move*: the cut-and-migrate plan (``migration.plan_migration``: whole tails to workers
  with room, never later than staying, scored by time and worker-seconds), each move by KV
  or recomputed;
- *split*: the worker predicted last sheds sequences to the one predicted first
  (``tail_split.plan_split``);
- *reconfig*: every tail consolidated onto one worker with all the live workers' threads,
  the others released (``tail_cost.plan_reconfig``).

Split and reconfiguration fire only when sooner by the profile's medians and by each of
its repeats alone; a move when its plan says so. An action the engine does not support,
or that the profile cannot time, is refused with the reason, and every option considered
is in the choice's record. ``force`` takes one action whatever it is predicted to cost
(the forced-path tests, and a user who wants to see one): a forced move moves every tail
with the path forced ("kv" or "recompute"), a forced split or reconfiguration applies its
planner's plan even when it does not pay.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .migration import Migration
from .tail_cost import ReconfigChoice, StepProfile, plan_reconfig
from .tail_split import Shed, SplitChoice, plan_split

ACTIONS = ("stay", "move", "split", "reconfig")


@dataclass(frozen=True)
class Tail:
    """One paused worker's tail: per sequence (batch position order) its id, predicted
    remaining tokens and context tokens (prompt + generated so far)."""

    seq_ids: tuple[str, ...]
    remaining: tuple[float, ...]
    context: tuple[int, ...]


@dataclass(frozen=True)
class TailChoice:
    action: str  # one of ``ACTIONS``
    stay_s: float  # predicted seconds until the pool is done as is
    predicted_s: float  # ... after the action, landing included
    reason: str
    moves: tuple[Migration, ...] = ()  # action "move"
    path: str = ""  # a forced move's path ("kv" or "recompute"; "": each move's cheaper)
    split: SplitChoice | None = None  # action "split"
    reconfig: ReconfigChoice | None = None  # action "reconfig"
    options: dict[str, dict] = field(default_factory=dict)

    def to_record(self) -> dict:
        return {"action": self.action, "predicted_stay_s": self.stay_s,
                "predicted_s": self.predicted_s, "reason": self.reason,
                "options": self.options}


def moved_finish(tails: Mapping[str, Tail], threads: Mapping[str, int], moves:
                 Sequence[Migration], profile: StepProfile,
                 move_s: Callable[[int], float]) -> float:
    """When the pool is done after ``moves`` (whole or partial tails to other workers, each
    target landing the context it receives first), timed by ``profile``."""
    rem = {w: dict(zip(t.seq_ids, t.remaining)) for w, t in tails.items()}
    ctx = {w: dict(zip(t.seq_ids, t.context)) for w, t in tails.items()}
    landed = dict.fromkeys(threads, 0)
    for m in moves:
        for seq in m.seq_ids:
            rem.setdefault(m.target, {})[seq] = rem[m.source].pop(seq)
            landed[m.target] += int(ctx[m.source][seq])
    return max((move_s(landed[w]) if landed[w] else 0.0)
               + profile.decode_seconds(list(r.values()), threads[w])
               for w, r in rem.items() if r) if any(rem.values()) else 0.0


def every_tail_moves(tails: Mapping[str, Tail], idle: Sequence[str],
                     path: str) -> tuple[Migration, ...]:
    """A forced move: each paused tail, whole, to another worker (an idle one first, else
    the next paused one), by ``path``."""
    names = list(tails)
    moves = []
    for i, w in enumerate(names):
        target = idle[i % len(idle)] if idle else names[(i + 1) % len(names)]
        if target == w:
            continue
        moves.append(Migration(w, target, tails[w].seq_ids, int(sum(tails[w].context)),
                               0.0, 0.0, 0.0, 0.0, 0.0, f"forced: every tail moves ({path})",
                               "transfer" if path == "kv" else "recompute"))
    return tuple(moves)


def choose_tail(tails: Mapping[str, Tail], idle: Sequence[str], threads: Mapping[str, int],
                profile: StepProfile, supported: frozenset[str],
                migrations: Sequence[Migration], move_s: Callable[[int], float],
                force: str = "") -> TailChoice:
    """The action for the pool's paused ``tails`` (module docstring). ``idle``: workers
    with nothing left; ``threads``: each worker's (paused and idle); ``supported``: the
    engine's ``tail_actions``; ``migrations``: the policy's cut-and-migrate plan;
    ``move_s``: predicted seconds to land that many context tokens on a worker; ``force``:
    "" (choose) or an engine tail action."""
    live = {w: t for w, t in tails.items() if t.seq_ids}
    stay_s = max((profile.decode_seconds(t.remaining, threads[w]) for w, t in live.items()),
                 default=0.0)
    options: dict[str, dict] = {"stay": {"predicted_s": stay_s}}
    refused = {a: f"the engine cannot {a} a paused tail" for a in ("split", "reconfig")
               if a not in supported}
    if force in ("kv", "recompute"):
        moves = every_tail_moves(live, idle, force)
        s = moved_finish(live, threads, moves, profile, move_s)
        return TailChoice("move", stay_s, s, f"forced: every tail moves by {force}",
                          moves=moves, path=force, options=options)
    if force == "stay":
        return TailChoice("stay", stay_s, stay_s, "forced: every tail resumes in place",
                          options=options)
    candidates: list[tuple[float, int, TailChoice]] = []
    if migrations:
        s = moved_finish(live, threads, migrations, profile, move_s)
        options["move"] = {"predicted_s": s, "moves": len(migrations)}
        candidates.append((s, 1, TailChoice("move", stay_s, s, migrations[0].reason,
                                            moves=tuple(migrations))))
    else:
        options["move"] = {"refused": "the cut-and-migrate plan keeps every tail"}
    if "split" in refused:
        options["split"] = {"refused": refused["split"]}
    else:
        split = plan_split({w: t.remaining for w, t in live.items()},
                           {w: t.context for w, t in live.items()}, threads, profile, move_s)
        if force == "split" and not split.fire:
            split = _forced_split(live, threads, split)
        options["split"] = split.to_record()
        if split.fire:
            candidates.append((split.split_s, 2, TailChoice(
                "split", stay_s, split.split_s, split.reason, split=split)))
    if "reconfig" in refused:
        options["reconfig"] = {"refused": refused["reconfig"]}
    else:
        plan = plan_reconfig({w: t.remaining for w, t in live.items()},
                             {w: threads[w] for w in live}, profile,
                             {w: sum(move_s(sum(o.context)) for v, o in live.items() if v != w)
                              for w in live})
        options["reconfig"] = plan.to_record()
        if plan.fire or (force == "reconfig" and len(live) >= 2):
            if not plan.fire:  # forced: onto the worker with the cheapest landing
                plan = _forced_reconfig(plan, live, threads, move_s)
            candidates.append((plan.move_s, 3, TailChoice(
                "reconfig", stay_s, plan.move_s, plan.reason, reconfig=plan)))
    if force:
        chosen = [c for _, _, c in candidates if c.action == force]
        if not chosen:
            why = options[force].get("refused") or f"{force} planned nothing to do"
            return TailChoice("stay", stay_s, stay_s, f"forced {force}: {why}; stay",
                              options=options)
        return _with(chosen[0], options, "forced: ")
    if not candidates:
        return TailChoice("stay", stay_s, stay_s, "no action finishes sooner: stay",
                          options=options)
    _, _, best = min(candidates, key=lambda c: (c[0], c[1]))
    if best.action != "move" and best.predicted_s >= stay_s:
        return TailChoice("stay", stay_s, stay_s, "no action finishes sooner: stay",
                          options=options)
    return _with(best, options)


def _forced_split(live: Mapping[str, Tail], threads: Mapping[str, int],
                  plan: SplitChoice) -> SplitChoice:
    """A forced split: its plan's sheds, or, where no shed pays, every other sequence of
    the tail with the most tokens left to the worker with the fewest."""
    moves = plan.moves
    if not moves and live:
        left = {w: sum(live[w].remaining) if w in live else 0.0 for w in threads}
        source = max(live, key=left.get)
        target = min((w for w in threads if w != source), key=left.get, default=None)
        positions = tuple(range(1, len(live[source].seq_ids), 2))
        if target is not None and positions:
            moves = (Shed(source, target, positions,
                          sum(live[source].context[p] for p in positions)),)
    return SplitChoice(bool(moves), moves, plan.stay_s, plan.split_s, plan.finish_s,
                       plan.reason)


def _forced_reconfig(plan: ReconfigChoice, live: Mapping[str, Tail],
                     threads: Mapping[str, int], move_s: Callable[[int], float]
                     ) -> ReconfigChoice:
    target = min(live, key=lambda w: sum(move_s(sum(o.context))
                                         for v, o in live.items() if v != w))
    return ReconfigChoice(True, target, sum(threads[w] for w in live), plan.stay_s,
                          plan.move_s, plan.overhead_s, plan.stay_core_s, plan.move_core_s,
                          plan.reason)


def _with(choice: TailChoice, options: dict, prefix: str = "") -> TailChoice:
    return TailChoice(choice.action, choice.stay_s, choice.predicted_s,
                      prefix + choice.reason, choice.moves, choice.path, choice.split,
                      choice.reconfig, options)
