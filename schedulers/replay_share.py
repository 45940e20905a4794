"""How many replayed groups a batch takes: a pure policy of the measured generation/update
balance (state in, decision out), shared by the live runner and the simulator.

A batch trains ``fresh`` generated groups plus ``replayed`` ones from the buffer. Two ways
to mix them, by mode:

* **replace** (``mode = "replay"``, generation and update one after the other): replayed
  groups take the place of fresh prompts, so the batch keeps its size and generation
  shrinks. A replayed group saves the generation of one prompt and is worth less than a
  fresh one (it was trained on already, at a stale baseline), so it pays in proportion to
  how much generation weighs: ``replayed = round(max_share * B * min(1, g / u))``, with ``g``
  the seconds to generate a whole batch of ``B`` prompts and ``u`` the update's seconds for
  ``B`` groups. Generation the bottleneck (``g >= u``): the whole ``max_share``; generation
  a third of the step (``g = u / 2``): half of it.
* **fill** (``mode = "async+replay"``, generation overlaps the update): every batch keeps
  its ``B`` fresh prompts and replayed groups fill the trainer's idle time while the next
  batch is generated: ``replayed = floor((g - u) / (u / B))``, at most ``max_share * B``.
  Generation the bottleneck: the trainer takes replayed groups for free; update the
  bottleneck: none, and the mode is async.

Both are bounded by the **gradient share**: fresh groups whose rewards are all equal carry
no gradient, replayed ones always do (the buffer keeps only those), so as the policy
improves the replayed rows would carry ever more of the update, all from a stale policy and
trained on before. ``max_grad_share`` caps the replayed share of the
informative groups: with ``f`` the smoothed informative fraction of fresh groups,
``replayed <= s / (1 - s) * f * fresh`` (``s = max_grad_share``; replace solves it with
``fresh = B - replayed``).

``fixed`` sharing ignores the balance: ``round(max_share * B)`` replaced (replace) or added
(fill). Either way the buffer bounds what is drawn: only groups within the staleness limit
``replay_max_age`` are there to take, and ``ReplayShare.decide`` records how many were.

Measured seconds are smoothed (EWMA, ``alpha``) and scaled to a whole batch (generation per
prompt generated, update per group trained), so the decision does not chase the share it
chose itself. Before the first measurement the share is ``max_share``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SHARINGS = ("fixed", "adaptive")
MIXES = ("replace", "fill")


@dataclass(frozen=True)
class ShareDecision:
    """One decision: ``replayed`` groups for a batch of ``batch`` prompts."""

    replayed: int
    fresh: int  # prompts to generate
    gen_s: float | None  # smoothed seconds to generate ``batch`` prompts
    update_s: float | None  # smoothed update seconds for ``batch`` groups
    reason: str

    def to_record(self) -> dict:
        return {"replayed": self.replayed, "fresh": self.fresh, "gen_s": self.gen_s,
                "update_s": self.update_s, "reason": self.reason}


@dataclass
class ReplayShare:
    """The share policy; ``observe`` after each update, ``decide`` before each draw."""

    batch: int
    max_share: float
    mix: str = "replace"
    sharing: str = "adaptive"
    max_grad_share: float = 1.0
    alpha: float = 0.5
    gen_s: float | None = None  # EWMA, per whole batch
    update_s: float | None = None
    informative: float | None = None  # EWMA of the fresh groups' informative fraction

    def __post_init__(self) -> None:
        if self.mix not in MIXES or self.sharing not in SHARINGS:
            raise ValueError(f"ReplayShare: mix must be one of {MIXES} and sharing one of "
                             f"{SHARINGS}, got {self.mix!r}, {self.sharing!r}")
        if not 0 < self.max_grad_share <= 1:
            raise ValueError(f"ReplayShare: max_grad_share must be in (0, 1], got "
                             f"{self.max_grad_share}")
        if not 0 <= self.max_share < 1 or self.batch < 1 or not 0 < self.alpha <= 1:
            raise ValueError(f"ReplayShare: need batch >= 1, 0 <= max_share < 1 and "
                             f"0 < alpha <= 1, got {self.batch}, {self.max_share}, "
                             f"{self.alpha}")

    @property
    def most(self) -> int:
        """The most replayed groups a batch may take (replace: one prompt stays fresh)."""
        top = round(self.max_share * self.batch)
        return min(top, self.batch - 1) if self.mix == "replace" else top

    def observe(self, gen_seconds: float, prompts_generated: int, update_seconds: float,
                groups_trained: int, informative_frac: float = 1.0) -> None:
        """Fold in one iteration's measured generation and update seconds and the
        informative fraction of its fresh groups."""
        if prompts_generated < 1 or groups_trained < 1:
            return
        gen = gen_seconds * self.batch / prompts_generated
        update = update_seconds * self.batch / groups_trained
        self.gen_s = self._smooth(self.gen_s, gen)
        self.update_s = self._smooth(self.update_s, update)
        self.informative = self._smooth(self.informative, informative_frac)

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else self.alpha * new + (1 - self.alpha) * old

    def decide(self) -> ShareDecision:
        """The replayed and fresh counts of the next batch (module docstring)."""
        g, u = self.gen_s, self.update_s
        if self.sharing == "fixed" or g is None or u is None or u <= 0:
            why = "fixed share" if self.sharing == "fixed" else "no measurement yet"
            return self._decision(self.most, why)
        if self.mix == "replace":
            want = round(self.max_share * self.batch * min(1.0, g / u))
            why = f"replace: max_share·B·min(1, g/u), g/u={g / u:.2f}"
        else:
            want = math.floor(max(g - u, 0.0) / (u / self.batch))
            why = f"fill the trainer's idle time: (g-u)/(u/B), g-u={g - u:.2f}s"
        return self._decision(min(want, self.most), why)

    def grad_bound(self) -> int | None:
        """The most replayed groups the gradient share allows (None: no bound)."""
        if self.max_grad_share >= 1 or self.informative is None:
            return None
        k = self.max_grad_share / (1 - self.max_grad_share) * self.informative
        fresh = self.batch / (1 + k) if self.mix == "replace" else self.batch
        return math.floor(k * fresh + 1e-9)

    def _decision(self, replayed: int, reason: str) -> ShareDecision:
        bound = self.grad_bound()
        if bound is not None and bound < replayed:
            replayed, reason = bound, (f"{reason}; gradient share <= {self.max_grad_share} at "
                                       f"informative fraction {self.informative:.2f}")
        fresh = self.batch - replayed if self.mix == "replace" else self.batch
        return ShareDecision(replayed, fresh, self.gen_s, self.update_s, reason)
