"""Cost ledger: worker lifetimes per pool, priced per worker-second, attributed to iterations.

Users pay for worker-seconds (GPU-seconds on a GPU pool) from the moment a worker starts
until it stops, its cold start (process start + model load) included. The ledger records:

- worker lifetimes: ``worker_started`` (billing starts, possibly ``cold_start_s`` before the
  moment the caller saw the worker), ``worker_ready`` (engine loaded: the cold start ends),
  ``worker_stopped`` (billing ends). A name may start again after it stopped;
- stage spans: ``mark(stage, iteration, t_start, t_end)``.

From these it answers worker-seconds and cost up to a time, and attributes them to iterations
and stages by overlapping each lifetime with each span. Spans that overlap each other (an
asynchronous run, parallel stages) are each billed the overlap, so their sum can exceed the
total; time outside every span is not attributed (``unattributed_worker_s`` in the totals).

Pure: every time is passed in (seconds on any one clock, e.g. unix time); the ledger never
reads the clock, so the live plugin and the simulator feed it alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class _Life:
    name: str
    pool: str
    t_start: float  # billing starts
    t_ready: float | None = None
    t_stop: float | None = None


class CostLedger:
    """Worker lifetimes and stage spans, priced by ``prices[pool]`` per worker-second."""

    def __init__(self, prices: Mapping[str, float]) -> None:
        bad = {k: v for k, v in prices.items() if not (np.isfinite(v) and v >= 0)}
        if not prices or bad:
            raise ValueError(
                f"CostLedger: prices {dict(prices)!r}; give at least one pool with a finite "
                "price >= 0 per worker-second, e.g. {'gen': 1.0, 'train': 1.0}"
            )
        self.prices = {str(k): float(v) for k, v in prices.items()}
        self._lives: list[_Life] = []
        self._running: dict[str, _Life] = {}
        self._marks: list[tuple[str, int, float, float]] = []

    # ---- events ------------------------------------------------------------------------

    def worker_started(self, name: str, pool: str, t: float, cold_start_s: float = 0.0) -> None:
        """A worker of ``pool`` started; billing starts at ``t - cold_start_s``.

        Pass ``cold_start_s`` when the worker was seen only after part of its start-up (e.g.
        on registering with the scheduler, with the process start time reported by it)."""
        if pool not in self.prices:
            raise ValueError(
                f"CostLedger.worker_started({name!r}): pool {pool!r} has no price; "
                f"known pools: {sorted(self.prices)}"
            )
        if name in self._running:
            raise ValueError(f"CostLedger.worker_started: worker {name!r} is already running")
        if not cold_start_s >= 0:
            raise ValueError(f"CostLedger.worker_started({name!r}): cold_start_s must be >= 0")
        life = _Life(name, pool, float(t) - float(cold_start_s))
        self._lives.append(life)
        self._running[name] = life

    def _life(self, name: str, where: str, t: float) -> _Life:
        life = self._running.get(name)
        if life is None:
            raise ValueError(f"CostLedger.{where}: worker {name!r} is not running")
        if t < life.t_start:
            raise ValueError(
                f"CostLedger.{where}({name!r}): t={t} is before its start {life.t_start}"
            )
        return life

    def worker_ready(self, name: str, t: float) -> None:
        """The worker's engine is loaded at ``t``; its cold start is ``t`` minus its start."""
        self._life(name, "worker_ready", t).t_ready = float(t)

    def worker_stopped(self, name: str, t: float) -> None:
        """The worker stopped at ``t``; billing ends."""
        self._life(name, "worker_stopped", t).t_stop = float(t)
        del self._running[name]

    def mark(self, stage: str, iteration: int, t_start: float, t_end: float) -> None:
        """Stage ``stage`` of ``iteration`` ran from ``t_start`` to ``t_end``."""
        if not t_end >= t_start:
            raise ValueError(
                f"CostLedger.mark({stage!r}, {iteration}): t_end={t_end} < t_start={t_start}"
            )
        self._marks.append((str(stage), int(iteration), float(t_start), float(t_end)))

    # ---- queries -----------------------------------------------------------------------

    def _spans(self, until: float | None, pool: str | None = None) -> tuple[np.ndarray, ...]:
        """Billed [start, end) of each lifetime, its pool's price, and its pool name."""
        lives = [x for x in self._lives if pool is None or x.pool == pool]
        if until is None and any(x.t_stop is None for x in lives):
            running = sorted(x.name for x in lives if x.t_stop is None)
            raise ValueError(
                f"CostLedger: workers {running} are still running; pass until=<time> to bill them"
            )
        start = np.array([x.t_start for x in lives], dtype=np.float64)
        end = np.array([x.t_stop if x.t_stop is not None else until for x in lives], dtype=float)
        if until is not None:
            end = np.minimum(end, until)
        price = np.array([self.prices[x.pool] for x in lives], dtype=np.float64)
        pools = np.array([x.pool for x in lives], dtype=object)
        return start, np.maximum(end, start), price, pools

    def worker_seconds(self, pool: str | None = None, until: float | None = None) -> float:
        """Worker-seconds billed up to ``until`` (required while a worker is running)."""
        start, end, _, _ = self._spans(until, pool)
        return float(np.sum(end - start))

    def cost(self, until: float | None = None) -> float:
        """Total cost up to ``until``: worker-seconds times each pool's price."""
        start, end, price, _ = self._spans(until)
        return float(np.sum((end - start) * price))

    def _attribute(
        self, keys: list[tuple[tuple[str, Any], ...]], spans: np.ndarray, until: float | None
    ) -> list[dict[str, Any]]:
        start, end, price, pools = self._spans(until)
        # overlap[m, w]: seconds of lifetime w inside span m
        overlap = np.clip(
            np.minimum(spans[:, 1:2], end[None, :]) - np.maximum(spans[:, 0:1], start[None, :]),
            0.0,
            None,
        )
        rows = []
        for m, key in enumerate(keys):
            row: dict[str, Any] = dict(key)
            row.update(t_start=float(spans[m, 0]), t_end=float(spans[m, 1]))
            row["wall_s"] = row["t_end"] - row["t_start"]
            for pool in self.prices:
                row[f"{pool}_worker_s"] = float(overlap[m, pools == pool].sum())
            row["worker_s"] = float(overlap[m].sum())
            row["cost"] = float(overlap[m] @ price)
            rows.append(row)
        return rows

    def by_iteration(self, until: float | None = None) -> list[dict[str, Any]]:
        """Per iteration (span = first mark start to last mark end): wall seconds,
        ``<pool>_worker_s`` for every priced pool, ``worker_s`` and ``cost``; sorted."""
        spans: dict[int, list[float]] = {}
        for _, it, t0, t1 in self._marks:
            s = spans.setdefault(it, [t0, t1])
            s[0], s[1] = min(s[0], t0), max(s[1], t1)
        its = sorted(spans)
        arr = np.array([spans[i] for i in its], dtype=np.float64).reshape(-1, 2)
        return self._attribute([(("iteration", i),) for i in its], arr, until)

    def by_stage(self, until: float | None = None) -> list[dict[str, Any]]:
        """Per mark, in the order marked: the same columns as ``by_iteration`` plus ``stage``."""
        keys = [(("iteration", it), ("stage", st)) for st, it, _, _ in self._marks]
        arr = np.array([m[2:] for m in self._marks], dtype=np.float64).reshape(-1, 2)
        return self._attribute(keys, arr, until)

    def totals(self, until: float | None = None) -> dict[str, float]:
        """Whole-run worker-seconds per pool, cost, and worker-seconds outside every iteration."""
        start, end, price, pools = self._spans(until)
        out = {f"{p}_worker_s": float((end - start)[pools == p].sum()) for p in self.prices}
        out["worker_s"] = float(np.sum(end - start))
        out["cost"] = float(np.sum((end - start) * price))
        spans = sorted((r["t_start"], r["t_end"]) for r in self.by_iteration(until))
        covered = 0.0  # union of iteration spans, intersected with each lifetime
        merged: list[list[float]] = []
        for t0, t1 in spans:
            if merged and t0 <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], t1)
            else:
                merged.append([t0, t1])
        for t0, t1 in merged:
            covered += float(np.clip(np.minimum(t1, end) - np.maximum(t0, start), 0, None).sum())
        out["unattributed_worker_s"] = out["worker_s"] - covered
        return out

    def cold_starts(self, pool: str | None = None) -> list[float]:
        """Measured cold starts (ready minus billing start) of lifetimes that became ready."""
        return [
            x.t_ready - x.t_start
            for x in self._lives
            if x.t_ready is not None and (pool is None or x.pool == pool)
        ]

    def running(self, pool: str | None = None) -> list[str]:
        """Names of workers started and not stopped, optionally of one pool."""
        return [n for n, x in self._running.items() if pool is None or x.pool == pool]

    def records(self, until: float | None = None) -> list[dict[str, Any]]:
        """One row per worker lifetime and per stage mark, with the same keys in every row
        (``kind`` is "worker" or "stage"; fields that do not apply are None), for a Parquet
        or JSONL file. Running workers have ``t_end`` None and are billed up to ``until``."""
        rows = []
        for x in self._lives:
            end = x.t_stop if x.t_stop is not None else until
            if end is not None and until is not None:
                end = min(end, until)
            seconds = None if end is None else max(end - x.t_start, 0.0)
            rows.append({
                "kind": "worker", "name": x.name, "pool": x.pool, "stage": None,
                "iteration": None, "t_start": x.t_start, "t_ready": x.t_ready, "t_end": x.t_stop,
                "cold_start_s": None if x.t_ready is None else x.t_ready - x.t_start,
                "worker_s": seconds,
                "cost": None if seconds is None else seconds * self.prices[x.pool],
            })
        for st, it, t0, t1 in self._marks:
            rows.append({
                "kind": "stage", "name": None, "pool": None, "stage": st, "iteration": it,
                "t_start": t0, "t_ready": None, "t_end": t1, "cold_start_s": None,
                "worker_s": None, "cost": None,
            })
        return rows
