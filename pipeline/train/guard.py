"""The collapse guard: a run whose quality falls is caught while it falls.

Two signals, read from the records the loop appends to metrics.jsonl (so a resumed run
rebuilds its guard from its own file, ``CollapseGuard.from_records``):

* **held-out**: an evaluation's accuracy more than ``collapse_drop`` below the best one so far;
* **reward**: the training reward, averaged over the last ``WINDOW`` iterations, more than
  ``collapse_drop`` below its best average *while* the responses, averaged alike, are at least
  ``collapse_length_growth`` times as long as at that best. A batch's reward also falls on
  harder prompts; falling while the responses lengthen is the collapse bench/stability.py
  found in async runs (responses 18 → 54 tokens that lose their structure, reward 0.79 → 0.03).

Either fall must also exceed ``Z`` standard errors of the difference of the two means (each
read as a mean of ``n`` rewards in [0, 1], variance ``p (1 - p) / n``): on a handful of
held-out prompts a fall of 0.1 is noise. With the defaults (256 held-out prompts, 256 samples
an iteration) the drop is the binding test.

A fall is said in one line and recorded (``event = "collapse"``), once per best: a signal that
fell is said again only after it has set a new best. Then ``on_collapse`` decides:

* ``"warn"``: the run goes on.
* ``"rollback"``: the run goes back to its last good state (``Durable.rollback``: the newest
  checkpoint at or before it; the iterations since are dropped, as a recovery drops them, and
  the newer checkpoints with them) and goes on with the learning rate times
  ``rollback_lr_factor``; the guard forgets what it saw after that checkpoint. After
  ``max_rollbacks`` rollbacks the next fall stops the run. For a held-out fall the last good
  state is the newest evaluation at or after the best that the held-out prompts cannot tell
  from it (not ``Z`` standard errors below it) and that no earlier rollback went back to (the
  best itself at the latest): a run that held its best for 60 iterations and fell at the last
  goes back a few iterations, not 60 (measured: async seed 1 went back from 80 to 15 when the
  best was the state to return to). "Within ``collapse_drop``" was tried and is too loose: a
  state already 0.07 down was returned to, fell again, and the run used up its rollbacks
  (async seed 3). For a reward fall it is the first iteration of the best window.
* ``"stop"``: ``Collapsed``, one line naming the checkpoint to go back to.

The newest checkpoint at or before each signal's best is kept beyond ``keep_checkpoints``
(``anchors``, which the loop hands to ``Durable``), so there is always one to go back to.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import fmean

from ..config import Config
from ..durable.runs import RunDir

WINDOW = 3  # iterations the reward and the response length are averaged over
Z = 2.0  # standard errors a fall must exceed (see the module docstring)


def significant(best: float, n_best: int, now: float, n_now: int) -> bool:
    """Whether ``now`` (a mean of ``n_now``) is more than ``Z`` standard errors below
    ``best`` (a mean of ``n_best``), each a mean of rewards in [0, 1]."""
    var = sum(min(max(p, 0.0), 1.0) * (1 - min(max(p, 0.0), 1.0)) / max(n, 1)
              for p, n in ((best, n_best), (now, n_now)))
    return best - now > Z * math.sqrt(var)


class Collapsed(RuntimeError):
    """The run's quality fell (``on_collapse = "stop"``, or rollbacks exhausted)."""


@dataclass(frozen=True)
class Fall:
    """A signal seen ``drop`` or more below its best."""

    signal: str  # "heldout" or "reward"
    iteration: int  # where the fall was seen
    best: float
    best_iteration: int
    back_to: int  # the newest checkpoint at or before this iteration holds a good policy
    now: float
    length_growth: float | None = None  # reward: the responses' length over the best's

    def line(self) -> str:
        grown = (f" while the responses grew {self.length_growth:.2f}x"
                 if self.length_growth is not None else "")
        name = "held-out accuracy" if self.signal == "heldout" else f"training reward (mean of " \
               f"{WINDOW} iterations)"
        return (f"iteration {self.iteration}: collapse: {name} {self.now:.3f}, down from its "
                f"best {self.best:.3f} at iteration {self.best_iteration}{grown}")


class CollapseGuard:
    """The two signals of one run; ``see`` each record as it is appended."""

    def __init__(self, drop: float, length_growth: float) -> None:
        self.drop, self.length_growth = drop, length_growth
        self.heldout: list[tuple[int, float, int]] = []  # (iteration, accuracy, prompts)
        self.train: list[tuple[int, float, float, int]] = []  # (it, reward, length, samples)
        self.said: dict[str, int] = {}  # signal -> the best iteration its fall was said for
        self.rollbacks = 0
        self.returned: set[int] = set()  # the states rollbacks went back to (``back_to``)

    @classmethod
    def from_records(cls, cfg: Config, records: list[dict]) -> CollapseGuard:
        """The guard of a run whose metrics.jsonl holds ``records``."""
        guard = cls(cfg.collapse_drop, cfg.collapse_length_growth)
        for record in records:
            if record.get("event") == "collapse" and record.get("action") == "rollback":
                guard.rollbacks += 1  # the records after its checkpoint were dropped then
                guard.said.clear()
                guard.returned.add(record["back_to"])
            elif record.get("event") == "collapse":
                guard.said[record["signal"]] = record["best_iteration"]
            else:
                guard.see(record)
        return guard

    def see(self, record: dict) -> Fall | None:
        """Take an iteration or eval record; the fall it shows, if one is to be said."""
        iteration = record.get("iteration")
        if record.get("event") == "eval" and "heldout_accuracy" in record:
            self.heldout.append((iteration, record["heldout_accuracy"],
                                 record.get("heldout_n", 1)))
            fall = self._heldout_fall()
        elif record.get("event") == "iteration" and "response_len_mean" in record:
            self.train.append((iteration, record["reward_mean"], record["response_len_mean"],
                               record.get("samples", 1)))
            fall = self._reward_fall()
        else:
            return None
        if fall is None or self.said.get(fall.signal) == fall.best_iteration:
            return None
        self.said[fall.signal] = fall.best_iteration
        return fall

    def _heldout_fall(self) -> Fall | None:
        best_at, best, n_best = max(self.heldout, key=lambda p: (p[1], p[0]))  # the latest
        at, now, n_now = self.heldout[-1]
        if now < best - self.drop and significant(best, n_best, now, n_now):
            good = [it for it, acc, n in self.heldout if it >= best_at and it not in self.returned
                    and not significant(best, n_best, acc, n)]
            return Fall("heldout", at, best, best_at, max(good, default=best_at), now)
        return None

    def _averages(self) -> list[tuple[int, int, float, float, int]]:
        """(first iteration, last iteration, mean reward, mean length, samples) of each run
        of ``WINDOW`` iterations. The checkpoint of the first holds a policy that generated
        batches of the window (batch j is generated by the policy of iteration j - 1 or
        older)."""
        out = []
        for i in range(WINDOW - 1, len(self.train)):
            rows = self.train[i - WINDOW + 1:i + 1]
            out.append((rows[0][0], rows[-1][0], fmean(r[1] for r in rows),
                        fmean(r[2] for r in rows), sum(r[3] for r in rows)))
        return out

    def _best_average(self) -> tuple[int, int, float, float, int] | None:
        averages = self._averages()
        return max(averages, key=lambda a: (a[2], a[1])) if averages else None

    def _reward_fall(self) -> Fall | None:
        best = self._best_average()
        if best is None:
            return None
        first, best_at, top, best_length, n_best = best
        _, at, now, length, n_now = self._averages()[-1]
        growth = length / best_length if best_length > 0 else None
        if (now < top - self.drop and growth is not None and growth >= self.length_growth
                and significant(top, n_best, now, n_now)):
            return Fall("reward", at, top, best_at, first, now, growth)
        return None

    def anchors(self) -> tuple[int, ...]:
        """Where each signal's fall would go back to: a checkpoint at or before each is kept."""
        anchors = []
        if self.heldout:
            anchors.append(max(self.heldout, key=lambda p: (p[1], p[0]))[0])
        if best := self._best_average():
            anchors.append(best[0])
        return tuple(anchors)

    def went_back(self, fall: Fall, iteration: int) -> None:
        """The run went back to ``iteration`` (the checkpoint at or before ``fall.back_to``)."""
        self.forget_after(iteration)
        self.rollbacks += 1
        self.returned.add(fall.back_to)

    def forget_after(self, iteration: int) -> None:
        """Drop what was seen after ``iteration`` (the run went back to it)."""
        self.heldout = [p for p in self.heldout if p[0] <= iteration]
        self.train = [r for r in self.train if r[0] <= iteration]
        self.said.clear()


def collapse_record(fall: Fall, action: str, **extra) -> dict:
    """The metrics record of a fall and what was done about it (``extra`` overrides)."""
    return {"event": "collapse", **asdict(fall), "action": action} | extra


def respond(fall: Fall, cfg: Config, guard: CollapseGuard, run: RunDir, log) -> bool:
    """Say ``fall``; whether the run is to roll back. ``Collapsed`` if it is to stop
    (``on_collapse = "stop"``, or ``max_rollbacks`` done)."""
    log(fall.line())
    if cfg.on_collapse == "warn":
        run.append_metrics(collapse_record(fall, "warn"))
        return False
    if cfg.on_collapse == "rollback" and guard.rollbacks < cfg.max_rollbacks:
        return True
    run.append_metrics(collapse_record(fall, "stop"))
    why = ("on_collapse = 'stop'" if cfg.on_collapse == "stop"
           else f"{cfg.max_rollbacks} rollbacks done, max_rollbacks = {cfg.max_rollbacks}")
    raise Collapsed(f"{fall.line()}; the run stops ({why}); its last good state is the newest "
                    f"checkpoint of iteration {fall.back_to} or earlier under "
                    f"{run.path / 'checkpoints'}: export it, or start again with a lower lr")
