"""One rule from the run seed to every random draw of generation.

* ``generation_seed(run_seed, iteration)``: the seed of one iteration's generation
  (``SamplingParams.seed``), the same for every shard, worker and continuation;
* ``sequence_keys(seed, prompt_ids, sample_idx)``: one 64-bit key per sequence, from that
  seed, the prompt's id and the sample's index;
* ``uniforms(keys, counters)``: the uniform draw of each sequence's ``counter``-th token;
* ``prompt_seeds(seed, prompt_ids)``: one seed per prompt, for an engine that seeds each
  request and draws its n samples from it (vLLM).

A sampled token is a function of its sequence's key, its position in the response and the
model's distribution there, never of the batch it decodes in: the same prompts sample the
same responses whichever shard or worker they land on, whether the batch was cut and its
tail moved, resumed, merged with another or split. Keys are counter-based hashes
(SplitMix64 over BLAKE2b of the ids), so no generator state travels with a paused tail.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def generation_seed(run_seed: int, iteration: int) -> int:
    """The generation seed of ``iteration`` of a run seeded ``run_seed`` (below 2**63)."""
    return _digest(f"generation/{run_seed}/{iteration}") >> 1


def sequence_keys(seed: int, prompt_ids: Sequence[str], sample_idx: Sequence[int]) -> np.ndarray:
    """The key (uint64) of each (prompt, sample) sequence under the generation ``seed``."""
    return np.array([_digest(f"{seed}/{p}/{s}") for p, s in zip(prompt_ids, sample_idx)],
                    dtype=np.uint64)


def prompt_seeds(seed: int, prompt_ids: Sequence[str]) -> list[int]:
    """The request seed (below 2**63) of each prompt under the generation ``seed``."""
    return [_digest(f"{seed}/{p}") >> 1 for p in prompt_ids]


def index_keys(seed: int, n: int) -> np.ndarray:
    """Keys of ``n`` anonymous sequences (numbered 0..n-1) under ``seed``."""
    return sequence_keys(seed, [""] * n, range(n))


def subkeys(keys: np.ndarray, salt: np.ndarray | int) -> np.ndarray:
    """Keys derived from ``keys`` and ``salt`` (a turn, a counter), one per key."""
    with np.errstate(over="ignore"):
        salted = (np.asarray(salt, dtype=np.uint64) + np.uint64(1)) * _GOLDEN
    return _mix(np.asarray(keys, dtype=np.uint64) ^ _mix(salted))


def uniforms(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """A uniform float64 in [0, 1) per (key, counter)."""
    return (subkeys(keys, counters) >> np.uint64(11)).astype(np.float64) * 2.0**-53
