"""PAT inside one simulated generation phase: merge a node's live workers into a higher TP.

After the cut-and-migrate events (``sim_migrate``), each node's workers (``NODE_GPUS //
tp`` of them, in pool order) are examined at the instants their sequences reach given
completion quantiles. At each instant the live workers' state is read as ``WorkerProgress``
(predicted remaining tokens from the policy, conditioned on what each sequence has
generated) and handed to ``pat.plan_tp`` with the per-TP profiles. When it merges:

- the live runs are cut at that instant; one worker of TP ``tp * m`` continues every
  unfinished sequence after the reconfiguration overhead, prefilling their contexts again
  when the plan recomputes the KV cache (nothing to prefill when it was transferred);
- the ``m`` workers whose GPUs it uses stay billed until it finishes; any other live
  worker of the node is released at once. GPUs are billed per lifetime times their count.

A node may reconfigure again at a later point (TP 1 -> 2 -> 8, say) while it still has two
live workers or more.
"""

from __future__ import annotations

import numpy as np

from .pat import TpChoice, plan_tp
from .sim_engine import simulate_run
from .sim_migrate import MigrationEvents

NODE_GPUS = 8  # TP stays inside a node (NVLink / PCIe peers)
# completion quantiles of a node's sequences at which PAT is consulted: every 5 % from 25 %,
# then finer in the last 5 % where the live batch shrinks fastest (PAT picks its point by
# prediction; a finer grid of candidate points lets ``plan_tp`` find it: -29.5 % / -35.2 %
# generation latency in PAT's two settings against -28.7 % / -34.3 % with 9 points)
QUANTILES = (*(round(0.25 + 0.05 * i, 2) for i in range(14)), 0.95, 0.97, 0.98, 0.99, 0.995,
             0.999)


class PatEvents:
    """Runs PAT's reconfiguration points over one iteration's ``MigrationEvents``."""

    def __init__(self, mig: MigrationEvents, lambda_cost: float) -> None:
        self.mig, self.lambda_cost = mig, lambda_cost
        prof = mig.profile
        self.profiles = {t: prof.variant(tp=t) for t in prof.feasible_tps()
                         if prof.tp <= t <= NODE_GPUS}
        self.n_reconfigurations = 0

    def run(self) -> None:
        mig = self.mig
        if len(self.profiles) < 2:
            return
        per_node = max(NODE_GPUS // mig.profile.tp, 1)
        for i in range(0, len(mig.names), per_node):
            self._node(mig.names[i:i + per_node])

    def _node(self, names: list[str]) -> None:
        mig = self.mig
        runs = [mig.current[w] for w in names if mig.current[w] is not None]
        if len(runs) < 2:
            return
        ends = np.sort(np.concatenate([r.finish_times() for r in runs]))
        ends = ends[np.isfinite(ends)]
        for q in QUANTILES:
            t = float(ends[min(int(q * ends.size), ends.size - 1)])
            live = [w for w in names if mig.current[w] is not None
                    and mig.current[w].t0 <= t < mig.current[w].t_finish]
            if len(live) < 2:
                return
            tp = mig.current[live[0]].gpus
            progress = [mig.progress(w, t)[0] for w in live]
            choice = plan_tp([(p.remaining_tokens, p.current_lengths) for p in progress],
                             self.profiles, tp, lambda_cost=self.lambda_cost)
            if choice.tp != tp:
                self._merge(t, live, choice)

    def _merge(self, t: float, live: list[str], choice: TpChoice) -> None:
        """Cut ``live`` at ``t``; the ``j``-th new worker runs ``choice.groups[j]`` on the
        GPUs of ``live[j*m : (j+1)*m]``, hosted by the first of them."""
        mig = self.mig
        m = choice.tp // mig.current[live[0]].gpus
        target = self.profiles[choice.tp]
        seqs, admitted = [], []
        for w in live:
            run = mig.close(w, t)  # the uncut run; its tokens so far are booked
            _, generated, adm = run.state_at(t)
            unfinished = generated < run.end - run.start
            seqs.append(run.seq[unfinished])
            admitted.append(adm[unfinished])
            mig.current[w] = None
        seqs, adm = np.concatenate(seqs), np.concatenate(admitted)
        done = mig.done_tokens[seqs]
        ctx = (mig.prompt[seqs] + done).astype(np.float64)
        # queued sequences were never prefilled; live ones only when the KV is recomputed
        prefill = np.where(adm & (choice.kv != "recompute"), 0.0, ctx)
        rem = mig.length[seqs] - done
        for j, g in enumerate(choice.groups):
            host = live[j * m]
            cap = target.batch_cap(float(ctx[g].mean() + rem[g].mean())) if g.size else 1
            mig.current[host] = simulate_run(t + choice.overhead_s, seqs[g], rem[g], ctx[g],
                                             prefill[g], target, cap)
            for w in live[j * m + 1:(j + 1) * m]:
                mig.merged[w] = host
        for w in live[len(choice.groups) * m:]:
            mig.released[w] = t
        self.n_reconfigurations += 1
