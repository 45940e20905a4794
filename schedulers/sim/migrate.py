"""Cut-and-migrate events inside one simulated generation phase.

The live scheduler asks ``ScalingPolicy.migrate`` when a worker pauses between chunks; the
simulator asks it at the instants that matter: when a worker's live batch falls to the
policy's ``tail_batch`` (local, RLHFless: the tail trigger), or once when ``tau`` of all
sequences are done (global, RLHFuse-like). At an event the state of every worker still
generating is read from its ``WorkerRun`` at that instant and handed to the policy as
``WorkerProgress``; the returned ``Migration``s are applied: a source is cut and released,
each target's run is cut and resumed with the incoming sequences queued, their context
recomputed or their KV cache shipped, as each ``Migration`` says (``sim_engine.resume_run``).

Which workers an event lists (local mode): every worker that has started and not yet
finished. Those that have not received sequences are reported paused (a simulated worker
can be cut at any step boundary), and the policy takes as sources those of them in their
tail, so a tail that stayed at one event is planned again, jointly with the others, at the
next. A worker that received sequences is never a source, so no sequence moves twice.
Predicted remaining tokens come from the policy (``SimPolicy.remaining``: conditioned on
what each sequence has generated).
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict

import numpy as np

from ..migration import Migration, WorkerProgress
from ..profiles import Profile
from .engine import WorkerRun, resume_run
from .sim_policy import SimPolicy
from .workloads import Batch


class MigrationEvents:
    """Runs the cut-and-migrate events of one iteration over the workers' runs."""

    def __init__(self, policy: SimPolicy, profile: Profile, cap: int, batch: Batch,
                 runs: dict[str, WorkerRun], length: np.ndarray, prompt: np.ndarray) -> None:
        self.policy, self.profile, self.cap = policy, profile, cap
        self.names = list(runs)
        self.current: dict[str, WorkerRun | None] = dict(runs)
        self.history: dict[str, list[WorkerRun]] = {w: [] for w in runs}
        self.released: dict[str, float] = {}  # source -> time it was cut and released
        self.length, self.prompt = length, prompt
        self.group = np.repeat(np.arange(batch.n_groups), batch.n_samples)
        self.done_tokens = np.zeros(length.size, dtype=np.int64)  # tokens of cut runs
        self.fin_before = dict.fromkeys(runs, 0)
        self.sinks: set[str] = set()
        self.n_migrations = self.n_moved = self.recompute_tokens = 0
        self.merged: dict[str, str] = {}  # worker -> the worker whose run holds its GPUs (PAT)
        self._sid = [str(j) for j in range(length.size)]

    # ---- events ----------------------------------------------------------------------------

    def run(self) -> None:
        mode = self.policy.cfg.migration
        if mode == "none" or len(self.names) < 2:
            return
        tau = self.policy.cfg.tau
        if mode == "global":
            ft = np.sort(np.concatenate([r.finish_times() for r in self.current.values()]))
            k = math.ceil(tau * ft.size)
            if k < ft.size:
                t = float(ft[max(k, 1) - 1])
                listed = [w for w in self.names if self.current[w].t_finish > t]
                progress = {w: self.progress(w, t)[0] for w in listed}
                self._apply(t, self.policy.migrate(progress))
            return
        few = self.policy.scaling.tail_batch()
        events = []
        for w in self.names:
            run = self.current[w]
            k = run.seq.size - math.floor(few) if math.isfinite(few) else 0
            if 0 < k < run.seq.size:  # its tail begins when its k-th sequence finishes
                events.append((float(np.sort(run.finish_times())[k - 1]), w))
        heapq.heapify(events)
        while events:
            t, w = heapq.heappop(events)
            if w in self.sinks or self.current[w] is None:
                continue
            progress = {}
            for v in self.names:
                run = self.current[v]
                if run is not None and run.t0 <= t < run.t_finish:  # started, not done
                    progress[v] = self.progress(v, t, paused=v not in self.sinks)[0]
            if len(progress) > 1:
                self._apply(t, self.policy.migrate(progress))

    def progress(self, w: str, t: float, paused: bool = False) -> tuple[WorkerProgress, float]:
        """``w``'s state at ``t`` as the policy sees it; ``paused``: it may be cut there."""
        run = self.current[w]
        fin, generated, _ = run.state_at(t)
        unf = ~fin
        seqs = run.seq[unf]
        gen_total = self.done_tokens[seqs] + generated[unf]
        n_fin = self.fin_before[w] + int(fin.sum())
        n_assigned = n_fin + int(seqs.size)
        remaining = self.policy.remaining(self.group[seqs], gen_total,
                                          self.length[seqs] - gen_total)
        prog = WorkerProgress(n_assigned, n_fin, [self._sid[j] for j in seqs.tolist()],
                              self.prompt[seqs] + gen_total, remaining, busy=not paused)
        return prog, prog.completion_fraction

    def close(self, w: str, t: float) -> WorkerRun:
        """Cut ``w``'s current run at ``t``, book what it generated, return the cut run."""
        run = self.current[w]
        cut = run.cut(t)
        self.done_tokens[cut.seq] += cut.end - cut.start
        self.fin_before[w] += int(cut.done.sum())
        self.history[w].append(cut)
        return run

    def _apply(self, t: float, plan: list[Migration]) -> None:
        if not plan:
            return
        incoming: dict[str, list[int]] = defaultdict(list)
        share: dict[str, list[float]] = defaultdict(list)  # prefill tokens per context token
        transfer = min(1.0, self.profile.kv_transfer_seconds(1.0)
                       * self.profile.prefill_tokens_per_s)
        for m in plan:
            incoming[m.target].extend(int(s) for s in m.seq_ids)
            share[m.target].extend([transfer if m.kv == "transfer" else 1.0] * len(m.seq_ids))
            self.n_migrations += 1
            self.n_moved += len(m.seq_ids)
            if m.kv == "recompute":
                self.recompute_tokens += m.recompute_tokens
        for src in {m.source for m in plan}:
            self.close(src, t)
            self.current[src] = None
            self.released[src] = t
        for tgt, seqs in incoming.items():
            old = self.close(tgt, t)
            inc = np.asarray(seqs, dtype=np.int64)
            done = self.done_tokens[inc]
            # the target's own sequences: their tokens so far are booked by _close, and
            # resume_run continues them from ``old``'s state at t
            ctx = (self.prompt[inc] + done).astype(np.float64)
            self.current[tgt] = resume_run(t, old, inc, self.length[inc] - done, ctx,
                                           self.profile, self.cap, ctx * np.asarray(share[tgt]))
            self.sinks.add(tgt)

    # ---- results ---------------------------------------------------------------------------

    def all_runs(self) -> list[WorkerRun]:
        runs = [r for w in self.names for r in self.history[w]]
        return runs + [r for r in self.current.values() if r is not None]

    def finish_times(self) -> dict[str, float]:
        """When each worker finished its last sequence or was released by a cut."""
        out = {}
        for w in self.names:
            h = w
            while h in self.merged:  # PAT: its GPUs serve another worker's run
                h = self.merged[h]
            run = self.current[h]
            out[w] = self.released[h] if run is None else run.t_finish
        return out

    def finished_per_worker(self) -> dict[str, int]:
        out = dict(self.fin_before)
        for w, run in self.current.items():
            if run is not None:
                out[w] += int(run.done.sum())
        return out

    def sequence_log(self) -> dict[str, np.ndarray]:
        """Per sequence: times finished, tokens generated (over all runs), and the index
        (in ``names``) of the worker that finished it; for conservation checks."""
        n = self.length.size
        finished, tokens = np.zeros(n, np.int64), np.zeros(n, np.int64)
        worker = np.full(n, -1, np.int64)
        for i, w in enumerate(self.names):
            runs = self.history[w] + ([self.current[w]] if self.current[w] is not None else [])
            for run in runs:
                np.add.at(tokens, run.seq, run.end - run.start)
                np.add.at(finished, run.seq[run.done], 1)
                worker[run.seq[run.done]] = i
        return {"finished": finished, "tokens": tokens, "worker": worker,
                "length": self.length.copy()}
