"""Training modes in the simulator: async (staleness k), replay and async+replay against sync.

Each mode runs the trace through the same ``Simulator`` (the same ``SimPolicy`` plans and
scales every generation) and the same replay share policy as the live runner
(``replay_share.ReplayShare``); this module only composes the simulated stage times the way
each mode orders them:

* **sync**: the scenario's own cluster and simulation: generate, reward, update, in turn.
* **replay** (replace): the scenario's cluster; before iteration i the share policy (replace,
  adaptive) picks ``R_i`` groups from the buffer, and the Simulator generates only the other
  ``B - R_i`` prompts of the batch (its first ones). The update trains all ``B`` groups: its
  seconds are the simulated ones scaled by ``B / (B - R_i)`` (an update's time is in
  proportion to its tokens; a replayed group stands for one of the same trace).
* **async** (AsyncFlow, bounded staleness k): generation and update must run on separate
  GPUs, so the cluster is split into a generation pool and a learner of ``train_gpus``
  (each split of ``SPLITS`` is tried; the fastest async one is kept for both async modes).
  With the simulated generation seconds ``g_i`` (plan to last reward) and update seconds
  ``u_i`` of that split, batch i may start once the generation pool is free and version
  ``i - 1 - k`` is published::

      gen_start_i = max(gen_end_{i-1}, upd_end_{i-1-k});  gen_end_i = gen_start_i + g_i
      upd_start_i = max(upd_end_{i-1}, gen_end_i);        upd_end_i = upd_start_i + u_i

  A batch's staleness is the trainer's version at its update minus the newest version
  published when its generation started; it is checked against k for every batch.
* **async+replay** (fill): as async, and each update also trains ``R_i`` replayed groups
  (share policy: fill, adaptive), which lengthen it by ``u_i * R_i / B``. ``R_i`` is also
  bounded by the groups in the buffer within ``replay_max_age`` versions of update i (a
  batch's groups join after its update; the buffer holds ``replay_size`` groups).

Throughput is trained samples (fresh and replayed) per simulated second, as in
``bench/modes.py``. The informative fraction of fresh groups, which bounds the replayed
gradient share live, is not simulated (taken as 1). Reported beside AsyncFlow's 1.59x
(average over its settings) and ReFlow's 2.06x (its best), both against their own sync
baselines (papers.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..profiles import Profile
from ..replay_share import ReplayShare
from .sim_policy import PolicyConfig
from .simulator import ClusterConfig, IterationResult, Simulator
from .workloads import Batch, Trace

PAPERS = {"async": ("AsyncFlow", 1.59), "async+replay": ("ReFlow", 2.06)}
SPLITS = (0.25, 0.375, 0.5, 0.625, 0.75)  # learner's share of the GPUs, async modes


@dataclass(frozen=True)
class ModeKnobs:
    """The mode knobs of ``pipeline/config.py`` that the simulation uses."""

    max_staleness: int = 1
    replay_ratio: float = 0.5
    replay_max_age: int = 3
    replay_size: int | None = None  # groups the buffer holds; None: 2 batches
    replay_share: str = "adaptive"


def _stages(res: IterationResult) -> tuple[float, float]:
    """(generation seconds: plan to last reward, update seconds: learner start to end)."""
    return res.reward_end - res.t_start, res.update_end - res.reward_end


def _summary(name: str, samples: float, total_s: float, replayed: float, **extra) -> dict:
    return {"mode": name, "samples": samples, "total_s": total_s,
            "samples_per_s": samples / total_s, "replayed_frac": replayed / samples, **extra}


def sync_mode(trace: Trace, profile: Profile, cluster: ClusterConfig,
              policy: PolicyConfig) -> dict[str, Any]:
    sim = Simulator(trace, profile, cluster, policy)
    total = sum(sim.step(b).step_s for b in trace.batches)
    samples = sum(b.lengths.size for b in trace.batches)
    return _summary("sync", samples, total, 0.0, staleness_max=0)


def replay_mode(trace: Trace, profile: Profile, cluster: ClusterConfig, policy: PolicyConfig,
                knobs: ModeKnobs) -> dict[str, Any]:
    """Synchronous steps, each generating only its fresh share (module docstring)."""
    batch = trace.batches[0].n_groups
    share = ReplayShare(batch, knobs.replay_ratio, mix="replace", sharing=knobs.replay_share)
    sim = Simulator(trace, profile, cluster, policy)
    total, samples, replayed = 0.0, 0, 0
    buffered = 0  # groups young enough for the next draw
    for b in trace.batches:
        want = min(share.decide().replayed, buffered)
        fresh = b.n_groups - want
        res = sim.step(_head(b, fresh))
        g, u = _stages(res)
        u_all = u * b.n_groups / fresh
        total += g + u_all
        samples += b.lengths.size
        replayed += want * b.n_samples
        share.observe(g, fresh, u_all, b.n_groups)
        buffered = min(fresh * knobs.replay_max_age, knobs.replay_size or 2 * batch)
    return _summary("replay", samples, total, replayed, staleness_max=knobs.replay_max_age)


def _head(b: Batch, groups: int) -> Batch:
    return dataclasses.replace(b, prompt_ids=b.prompt_ids[:groups],
                               prompt_tokens=b.prompt_tokens[:groups],
                               lengths=b.lengths[:groups],
                               workers=None if b.workers is None else b.workers[:groups])


def pipelined(g: list[float], u: list[float], batch: int, n_samples: int, knobs: ModeKnobs,
              replay: bool) -> dict[str, Any]:
    """The async recurrence of the module docstring over stage seconds ``g``, ``u``; with
    ``replay`` each update also trains the replayed groups the share policy (fill) and the
    buffer allow."""
    k = knobs.max_staleness
    share = ReplayShare(batch, knobs.replay_ratio, mix="fill", sharing=knobs.replay_share)
    size = knobs.replay_size or 2 * batch
    gen_end = upd_end = 0.0
    published: list[float] = []  # upd_end of every update so far (version j+1 at index j)
    versions, drawn = [], []  # the version that generated each batch; replayed per update
    for i in range(len(g)):
        gen_start = max(gen_end, published[i - 1 - k] if i - 1 - k >= 0 else 0.0)
        gen_end = gen_start + g[i]
        versions.append(sum(t <= gen_start for t in published))
        r = 0
        if replay:  # batches whose update is done by now, young enough for update i
            young = sum(batch for j in range(i) if published[j] <= gen_start
                        and i - versions[j] <= knobs.replay_max_age)
            r = min(share.decide().replayed, young, size)
        u_i = u[i] * (batch + r) / batch
        upd_end = max(upd_end, gen_end) + u_i
        published.append(upd_end)
        drawn.append(r)
        share.observe(g[i], batch, u_i, batch + r)
    staleness = [i - v for i, v in enumerate(versions)]
    if max(staleness) > k:
        raise RuntimeError(f"pipelined: a batch lags {max(staleness)} versions > k={k}")
    samples = (len(g) * batch + sum(drawn)) * n_samples
    extra = {"fill_bound_vs_async": fill_bound(float(np.mean(g)), float(np.mean(u)),
                                               knobs.replay_ratio)} if replay else {}
    return _summary("async+replay" if replay else "async", samples, upd_end,
                    sum(drawn) * n_samples, staleness_max=int(max(staleness)), **extra)


def async_modes(trace: Trace, profile: Profile, cluster: ClusterConfig, policy: PolicyConfig,
                knobs: ModeKnobs) -> list[dict[str, Any]]:
    """async and async+replay on the fastest split of ``cluster`` (for async)."""
    tp = profile.tp
    best: tuple[float, list[dict]] | None = None
    for frac in SPLITS:
        train = max(tp, int(cluster.gpus * frac) // tp * tp)
        if cluster.gpus - train < tp:
            continue
        split = ClusterConfig(cluster.gpus - train, train, colocated=False,
                              max_batch=cluster.max_batch)
        sim = Simulator(trace, profile, split, policy)
        g, u = zip(*(_stages(sim.step(b)) for b in trace.batches))
        batch, n = trace.batches[0].n_groups, trace.n_samples
        rows = [pipelined(list(g), list(u), batch, n, knobs, replay)
                | {"gen_gpus": cluster.gpus - train, "train_gpus": train}
                for replay in (False, True)]
        if best is None or rows[0]["samples_per_s"] > best[0]:
            best = (rows[0]["samples_per_s"], rows)
    if best is None:
        raise ValueError(f"async_modes: {cluster.gpus} GPUs cannot be split into a "
                         f"generation pool and a learner of tp={tp}")
    return best[1]


def simulate_modes(trace: Trace, profile: Profile, cluster: ClusterConfig,
                   policy: PolicyConfig, knobs: ModeKnobs = ModeKnobs()) -> list[dict[str, Any]]:
    """One row per mode, with ``vs_sync`` (throughput ratio) and the paper's figure."""
    rows = [sync_mode(trace, profile, cluster, policy),
            replay_mode(trace, profile, cluster, policy, knobs),
            *async_modes(trace, profile, cluster, policy, knobs)]
    base = rows[0]["samples_per_s"]
    for row in rows:
        row["vs_sync"] = row["samples_per_s"] / base
        paper = PAPERS.get(row["mode"])
        row["paper"] = f"{paper[0]} {paper[1]}x" if paper else ""
    return rows


def fill_bound(g: float, u: float, max_share: float) -> float:
    """The most async+replay (fill) can give over async for generation seconds ``g`` and
    update seconds ``u`` per batch: ``(1 + R/B) * max(g, u) / max(g, u (1 + R/B))`` with the
    largest ``R/B`` the trainer's idle time and ``max_share`` allow."""
    r = min(max_share, max(g - u, 0.0) / u)
    return (1 + r) * max(g, u) / max(g, u * (1 + r))
