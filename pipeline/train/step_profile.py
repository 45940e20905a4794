"""The decode step profile a run's tail decisions are timed by, measured on its own pool.

``measure_step_profile`` runs ``profile_steps_task`` (``tasks/tail.py``) as each side of a
reconfiguration would run: the pool's threads on every generation worker at once (staying,
they share the machine's memory bandwidth and caches), then all their threads on one worker
while the others idle (the consolidated tail). The elastic policy keeps the result
(``ScalingPolicy.step_profile``) and rescales it from each iteration's own decode steps
(``StepProfile.observe``); ``bench/tail_harness.py`` measures the same way.
"""

from __future__ import annotations

from distributed import wait

from rlhfless.ops.engine.engine_types import WeightsRef
from rlhfless.schedulers.tail_cost import StepProfile

from ..cluster.pools import PoolCluster
from ..tasks.rollout import GenSpec
from ..tasks.tail import profile_steps_task

BATCHES = (1, 2, 4, 8, 16)  # a step's cost bends between 1 and 2 sequences: measure both


def measure_step_profile(pc: PoolCluster, names: list[str], spec: GenSpec,
                         weights: WeightsRef, batches: tuple[int, ...] = BATCHES,
                         steps: int = 8, repeats: int = 5,
                         prompt_tokens: int = 32) -> StepProfile:
    """Decode step seconds by (batch, threads) on the generation workers ``names`` (see the
    module docstring); ``steps``, ``repeats`` and ``prompt_tokens`` as
    ``profile_steps_task``'s."""
    c, threads = pc.client, pc.pools["gen"].threads
    first = pc.address_of(names[0])
    shared = [c.submit(profile_steps_task, spec, weights, batches, (threads,), steps,
                       repeats=repeats, prompt_tokens=prompt_tokens,
                       workers=[pc.address_of(n)], pure=False) for n in names]
    stay = shared[0].result()
    wait(shared)
    wide = c.submit(profile_steps_task, spec, weights, batches, (threads * len(names),), steps,
                    repeats=repeats, prompt_tokens=prompt_tokens, workers=[first],
                    pure=False).result()
    return StepProfile(stay | wide)
