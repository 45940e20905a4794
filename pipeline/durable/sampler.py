"""The order in which a run draws its prompts: seeded, a new permutation every epoch."""

from __future__ import annotations

import numpy as np
import pyarrow as pa


class PromptSampler:
    """Batches of prompts in a seeded order; a new permutation every epoch.

    A batch never holds a prompt twice, also when it crosses an epoch boundary: each epoch's
    order is the permutation of (seed, epoch) with the last ``batch - 1`` prompts of the
    previous epoch held back from its first positions (a prompt ``d`` places from the end of
    epoch e comes at position ``batch - d`` of epoch e + 1 or later), so any ``batch`` or
    fewer consecutive prompts are distinct. Every epoch still holds every prompt once, and
    the order is a function of (seed, epoch) alone: ``position`` is the whole state."""

    def __init__(self, prompts: pa.Table, batch: int, seed: int) -> None:
        if len(prompts) < batch:
            raise ValueError(f"{len(prompts)} prompts, fewer than a batch of {batch}")
        self.prompts, self.batch, self.seed = prompts, batch, seed
        self.position = 0  # prompts consumed so far, over all epochs
        self._epoch, self._order = 0, self._permutation(0)  # the epoch last computed

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))

    def order(self, epoch: int) -> np.ndarray:
        """The prompt indices of ``epoch`` in the order they are drawn."""
        if epoch < self._epoch:
            self._epoch, self._order = 0, self._permutation(0)
        while self._epoch < epoch:
            self._epoch += 1
            self._order = held_back(self._permutation(self._epoch),
                                    self._order[len(self._order) - (self.batch - 1):])
        return self._order

    def next_batch(self, n: int | None = None) -> pa.Table:
        """The next ``n`` prompts (default, and at most: a whole batch)."""
        want = self.batch if n is None else n
        if want > self.batch:
            raise ValueError(f"next_batch({n}): at most a batch of {self.batch} prompts")
        rows: list[int] = []
        while len(rows) < want:
            epoch, offset = divmod(self.position, len(self.prompts))
            take = min(want - len(rows), len(self.prompts) - offset)
            rows.extend(self.order(epoch)[offset : offset + take].tolist())
            self.position += take
        return self.prompts.take(rows)


def held_back(order: np.ndarray, tail: np.ndarray) -> np.ndarray:
    """``order`` with each prompt of ``tail`` (the end of the previous epoch; its last item
    ``d = 1``) at position ``len(tail) + 1 - d`` or later; the others keep their relative
    order. The first positions are filled one at a time: a held-back prompt as soon as it may
    stand there, else the next of ``order`` that may. Possible whenever ``len(order)`` exceeds
    ``len(tail)``: by position k, ``len(order) - len(tail) + k`` prompts may stand there."""
    earliest = {int(p): i + 1 for i, p in enumerate(tail)}
    out: list[int] = []
    waiting: list[int] = []  # held back, in the order met
    rest = iter(order.tolist())
    while waiting or len(out) < len(tail):  # past that, every prompt may stand anywhere
        pos = len(out)
        ready = next((p for p in waiting if earliest[p] <= pos), None)
        if ready is not None:
            waiting.remove(ready)
            out.append(ready)
            continue
        p = next(rest)
        if earliest.get(p, 0) <= pos:
            out.append(p)
        else:
            waiting.append(p)
    return np.asarray(out + list(rest), dtype=order.dtype)
