"""Diagnostics of a batch that mixes fresh and replayed groups: why replay trains as it does.

``replay_diagnostics(fresh, replayed, trainer_version)`` reads the trainable rows of one
batch (``prompt_id``, ``policy_version``, ``reward``, ``advantage``, ``response_ids``; the
fresh rows and the replayed groups apart) and returns flat numbers for the run's metrics:

* ``replay_overlap_groups``: replayed groups whose prompt is also fresh in the batch (the
  same prompt trained twice, once with a stale baseline);
* ``batch_distinct_prompts`` and ``batch_diversity``: distinct prompts, and their share of
  the batch's groups (1.0: no prompt twice);
* ``replay_age_mean``, ``replay_age_max``: versions between a replayed group's policy and the
  trainer;
* ``replay_grad_token_share``: the replayed share of the tokens with a non-zero advantage,
  i.e. of the tokens that carry policy gradient (fresh groups whose rewards are all equal
  carry none; replayed ones always carry some, the buffer keeps only those);
* ``fresh_informative_frac`` and ``replayed_informative_frac``: groups with a non-zero
  advantage, per kind;
* ``fresh_adv_abs_mean`` and ``replayed_adv_abs_mean``: mean |advantage| per kind;
* ``fresh_reward_mean`` and ``replayed_reward_mean``: the replayed rows' rewards are the
  older policy's (a gap that grows with the policy's improvement);
* ``replay_adv_drift``: over replayed rows whose prompt is also fresh, the mean
  |stored advantage - advantage against the fresh group's baseline| (GRPO, ddof=1 std):
  how far the stored advantage is from what the current policy's samples would give it.
  Absent when no replayed prompt is fresh.

The trainer side of the picture (importance weights of the older rows) comes from
``ops/algo/update.py`` (``tis_weight_mean_older``, ``tis_truncated_frac_older``).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ..algo.advantage import group_index
from ..data.schema import TRAINABLE, check_columns

READS = pa.schema([TRAINABLE.field(n) for n in
                   ("prompt_id", "policy_version", "reward", "advantage", "response_ids")])


def _groups(table: pa.Table) -> tuple[np.ndarray, list[str], np.ndarray]:
    """Row group index [N], prompt ids [G], and [G] bool: the group has a non-zero advantage."""
    group, ids = group_index(table.column("prompt_id"))
    advantage = table.column("advantage").to_numpy()
    informative = np.bincount(group, weights=advantage != 0, minlength=len(ids)) > 0
    return group, ids, informative


def _grad_tokens(table: pa.Table) -> int:
    """Response tokens of the rows with a non-zero advantage."""
    lengths = np.array([len(r) for r in table.column("response_ids").to_pylist()], np.int64)
    return int(lengths[table.column("advantage").to_numpy() != 0].sum())


def _baseline_drift(fresh: pa.Table, replayed: pa.Table, overlap: set[str],
                    eps: float = 1e-6) -> float:
    """Mean |stored advantage - advantage against the fresh group| over the replayed rows
    of the prompts in ``overlap``."""
    f_prompt = np.array(fresh.column("prompt_id").to_pylist())
    f_reward = fresh.column("reward").to_numpy().astype(np.float64)
    r_prompt = np.array(replayed.column("prompt_id").to_pylist())
    r_reward = replayed.column("reward").to_numpy().astype(np.float64)
    stored = replayed.column("advantage").to_numpy().astype(np.float64)
    gaps = []
    for pid in sorted(overlap):
        rewards = f_reward[f_prompt == pid]
        std = rewards.std(ddof=1) if rewards.size > 1 else 0.0
        rows = r_prompt == pid
        centred = r_reward[rows] - rewards.mean()
        again = centred / (std + eps) if std > 0 else np.zeros_like(centred)
        gaps.append(np.abs(stored[rows] - again))
    return float(np.concatenate(gaps).mean())


def replay_diagnostics(fresh: pa.Table, replayed: list[pa.Table],
                       trainer_version: int) -> dict[str, float]:
    """The numbers of the module docstring for one batch: ``fresh`` rows, the ``replayed``
    groups (one table each, as ``ReplayBuffer.sample`` returns them), consumed by a trainer
    at ``trainer_version``."""
    check_columns(fresh, READS, "replay_diagnostics (fresh)")
    _, fresh_ids, fresh_info = _groups(fresh)
    out: dict[str, float] = {"fresh_informative_frac": float(fresh_info.mean())
                             if len(fresh_ids) else 0.0,
                             "fresh_adv_abs_mean": _abs_mean(fresh),
                             "fresh_reward_mean": _mean(fresh, "reward")}
    if not replayed:
        out |= {"batch_distinct_prompts": len(fresh_ids), "batch_diversity": 1.0}
        return out
    rows = pa.concat_tables(replayed)
    check_columns(rows, READS, "replay_diagnostics (replayed)")
    replayed_ids = [t.column("prompt_id")[0].as_py() for t in replayed]
    overlap = set(replayed_ids) & set(fresh_ids)
    distinct = len(set(fresh_ids) | set(replayed_ids))
    ages = np.array([trainer_version - int(t.column("policy_version").to_numpy().min())
                     for t in replayed])
    informative = np.array([bool(np.any(t.column("advantage").to_numpy() != 0))
                            for t in replayed])
    grad_fresh, grad_replayed = _grad_tokens(fresh), _grad_tokens(rows)
    out |= {
        "replay_overlap_groups": len([p for p in replayed_ids if p in overlap]),
        "batch_distinct_prompts": distinct,
        "batch_diversity": distinct / (len(fresh_ids) + len(replayed)),
        "replay_age_mean": float(ages.mean()), "replay_age_max": int(ages.max()),
        "replay_grad_token_share": grad_replayed / max(grad_fresh + grad_replayed, 1),
        "replayed_informative_frac": float(informative.mean()),
        "replayed_adv_abs_mean": _abs_mean(rows),
        "replayed_reward_mean": _mean(rows, "reward"),
    }
    if overlap:
        out["replay_adv_drift"] = _baseline_drift(fresh, rows, overlap)
    return out


def _abs_mean(table: pa.Table) -> float:
    return float(np.abs(table.column("advantage").to_numpy()).mean()) if len(table) else 0.0


def _mean(table: pa.Table, column: str) -> float:
    return float(table.column(column).to_numpy().mean()) if len(table) else 0.0
