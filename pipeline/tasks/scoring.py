"""Scoring tasks: the reward of each rollout and its advantage, stateless.

Each takes a shard's rows beside their generation statistics (``Generated``) and returns
them with columns added (``schema.SCORED``, ``schema.TRAINABLE``), the statistics passed on.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import pyarrow as pa

from rlhfless.ops.algo.advantage import compute_advantages, turn_advantages
from rlhfless.ops.data.schema import TRAINABLE
from rlhfless.ops.engine.gen_stats import Generated
from rlhfless.ops.rollouts.adapters import DATASET_ADAPTERS, adapter_of, reasoning_gym
from rlhfless.ops.rollouts.episode import score_episodes
from rlhfless.ops.rollouts.reward import VERIFIERS, score


@dataclass(frozen=True)
class RewardSpec:
    rewards: dict[str, str] = field(default_factory=dict)  # data_source -> verifier/"mod:fn"
    default: str = "math"
    timeout_s: float = 5.0
    fallback: float = 0.0


def resolve_reward(name: str):
    """A built-in verifier by name, a library's scorer (``"reasoning-gym:<task>"``), or a
    user function given as ``"module:function"``."""
    if name in VERIFIERS:
        return VERIFIERS[name]
    adapter = adapter_of(name, DATASET_ADAPTERS)
    if adapter is not None:
        return reasoning_gym.scorer(adapter[1])
    module, _, attr = name.partition(":")
    if not attr:
        raise ValueError(f"reward {name!r}: not a verifier {sorted(VERIFIERS)} or 'module:fn'")
    return getattr(importlib.import_module(module), attr)


def reward_task(rollouts: Generated, spec: RewardSpec) -> Generated:
    """The rollouts scored (``reward``, ``reward_error``), beside the same statistics."""
    table = rollouts.table
    if "env_reward" in table.column_names:  # episodes: their environment scored them
        return rollouts.with_table(score_episodes(table))
    fns = {source: resolve_reward(name) for source, name in spec.rewards.items()}
    return rollouts.with_table(score(table, fns, default=spec.default, timeout_s=spec.timeout_s,
                                     fallback=spec.fallback))


def advantage_task(scored: Generated, algorithm: str, n_samples: int,
                   turn_credit: str = "episode") -> Generated:
    """The scored rows with their ``advantage``, beside the same statistics; with
    ``turn_credit = "return_to_go"`` episodes get ``turn_advantage`` too (one per model turn,
    ``ops/algo/advantage.py``), which the update uses in place of ``advantage``."""
    table = scored.table
    if len(table) == 0:
        table = table.append_column(TRAINABLE.field("advantage"), pa.array([], pa.float32()))
    else:
        table = compute_advantages(table, algorithm, n_samples=n_samples)
    if turn_credit == "return_to_go" and "loss_mask" in table.column_names:
        table = table.append_column("turn_advantage", turn_advantages(table))
    return scored.with_table(table)
