"""What every worker's tasks share: the worker a task runs on, and what its engine may hold.

Engines are worker-local state reached from ordinary graph tasks, not Dask Actors: graph
tasks keep Dask's retries, resources, priorities and the rendered graph, while module
globals keep each worker process's model warm across tasks and iterations. The first task
on a worker loads the model (the *cold start*, measured and returned with the rollouts);
later tasks only fetch newer weights. Each worker pins torch to its share of the cores.
The tasks, by role:

* ``rollout.py``: generation workers (resource ``GEN``) hold a generation backend
  (hf or vllm, ``ops/engine/protocol.py``) at some policy version, and the chunks paused there;
* ``scoring.py``: rewards and advantages, stateless, on either pool;
* ``trainer.py``: the trainer (resource ``TRAIN``) holds policy, optimizer, frozen
  reference, updates and publishes, and writes and reads its part of a checkpoint;
* ``tail.py``: a paused tail's KV cache moved between generation workers (engines that export it).
"""

from __future__ import annotations

from distributed import get_worker


def worker_name() -> str:
    try:
        return str(get_worker().name)
    except ValueError:  # called outside a worker (tests, the sync scheduler)
        return "local"


# the share of a worker's memory limit a CPU engine's process may hold once loaded: what
# generation allocates after the load (an agent endpoint's requests, LoRA's buffers) goes on
# top (at 0.7, the agent task's workers on vLLM's CPU build crossed Dask's 80 % pause)
ENGINE_RAM_SHARE = 0.6


def engine_ram_bytes() -> int | None:
    """The bytes a CPU engine's worker process may hold once its engine is loaded: its Dask
    memory limit times ``ENGINE_RAM_SHARE``. None outside a worker, or where the worker has
    no limit."""
    try:
        memory = get_worker().memory_manager
    except ValueError:
        return None
    if not memory.memory_limit:
        return None
    return int(memory.memory_limit * ENGINE_RAM_SHARE)
