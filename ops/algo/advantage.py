"""The advantage stage: group-relative advantages per sequence (GRPO, RLOO).

``compute_advantages`` reads ``prompt_id`` and ``reward`` of a scored table and appends
``advantage`` (float32, one value per sequence), so its output has the ``TRAINABLE`` columns of
``ops/data/schema.py``. A group is all samples of one prompt; the caller passes whole groups (pass
``n_samples`` to have group sizes checked).

- GRPO: ``A_i = (r_i - mean_g) / (std_g + eps)`` with the sample standard deviation
  (``ddof=1``, as ``torch.std`` in veRL and TRL). ``scale=False`` gives ``A_i = r_i - mean_g``
  (Dr. GRPO). A group of one sample, or whose rewards are all equal, gets advantage 0 exactly.
- RLOO: ``A_i = r_i - mean of the other samples' rewards = n / (n - 1) * (r_i - mean_g)``;
  ``scale`` does not apply. A group of one sample has no baseline and is an error.

Arithmetic is float64 numpy over the whole table (no Python loop over rows); rows keep their
order.

Turn credit (``turn_advantages``, multi-turn episodes with ``turn_credit =
"return_to_go"``): each model turn k of an episode is credited with its return to go,
``G_k = sum(turn_rewards[k:]) + F`` (``F`` = the episode's reward less its steps' rewards:
``close()``'s final reward, a verifier's score), and normalised as GRPO does within its slot,
the turns k of one prompt's samples that reached turn k: ``A_k = (G_k - mean) / (std + eps)``
(``scale=False``: ``G_k - mean``), 0 for a slot of one turn or of equal returns. ``G_0`` is
the episode's reward, so turn 0 gets the sequence's own GRPO advantage; a later turn is
credited only with what followed it, against samples that got that far. A turn is a run of
generated tokens (``loss_mask``); a row where two turns touch (an environment that appended
nothing between them) cannot be split by turns and keeps its sequence advantage on every
token, out of the slots.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..data.schema import MAX_ABS_REWARD, SCORED, TRAINABLE, check_columns

READS = pa.schema([SCORED.field("prompt_id"), SCORED.field("reward")])
METHODS = ("grpo", "rloo")


def compute_advantages(
    scored: pa.Table,
    method: Literal["grpo", "rloo"] = "grpo",
    *,
    eps: float = 1e-6,
    scale: bool = True,
    n_samples: int | None = None,
) -> pa.Table:
    """Append ``advantage`` (float32) to ``scored``, computed within each ``prompt_id`` group.

    ``method`` is ``"grpo"`` or ``"rloo"`` (see the module docstring); ``eps`` keeps the GRPO
    division finite; ``scale=False`` skips the GRPO division by the group std. When
    ``n_samples`` is given every group must hold exactly that many rows. Raises ``ValueError``
    on a missing column, a null prompt_id or reward, a non-finite reward, or a group that the
    method cannot score. A reward past ``MAX_ABS_REWARD`` is refused too: the group std of
    ``1e300`` overflows and would zero the group's advantages without a word."""
    _check_arguments(scored, method, eps, n_samples)
    group, ids = group_index(scored.column("prompt_id"))  # group: [N] int64, ids: [G]
    reward = scored.column("reward").to_numpy().astype(np.float64)  # [N]
    _check_rewards(reward)
    count = np.bincount(group, minlength=len(ids))  # [G]
    _check_group_sizes(count, ids, method, n_samples)
    mean = np.bincount(group, weights=reward, minlength=len(ids)) / count  # [G]
    centred = reward - mean[group]  # [N]
    if method == "rloo":
        advantage = count[group] / (count[group] - 1) * centred
    else:
        advantage = grpo_advantages(centred, group, count, eps, scale)
    advantage[constant_groups(reward, group, len(ids))[group]] = 0.0
    return scored.append_column(
        TRAINABLE.field("advantage"), pa.array(advantage.astype(np.float32), pa.float32())
    )


def turn_advantages(trainable: pa.Table, *, eps: float = 1e-6, scale: bool = True) -> pa.Array:
    """Per row, one float32 advantage per model turn (module docstring: turn credit), from
    ``prompt_id``, ``reward``, ``advantage``, ``turn_rewards``, ``turns`` and ``loss_mask``.
    Slots are built by a loop over rows; the normalisation is ``grpo_advantages``'."""
    group, _ = group_index(trainable.column("prompt_id"))
    reward = trainable.column("reward").to_pylist()
    advantage = trainable.column("advantage").to_pylist()
    steps = trainable.column("turn_rewards").to_pylist()
    turns = trainable.column("turns").to_pylist()
    masks = trainable.column("loss_mask").to_pylist()
    slot_of: dict[tuple[int, int], int] = {}
    slots, returns, owner = [], [], []  # per credited turn: its slot, G_k, (row, k)
    n_runs = []
    for row, (mask, rewards) in enumerate(zip(masks, steps)):
        runs = count_turns(turn_of_tokens(mask))
        n_runs.append(runs)
        if runs != turns[row]:  # turns that touch: no split by turn
            continue
        final = reward[row] - sum(rewards)
        for k in range(runs):
            slots.append(slot_of.setdefault((int(group[row]), k), len(slot_of)))
            returns.append(sum(rewards[k:]) + final)
            owner.append((row, k))
    out = [[float(advantage[row])] * runs for row, runs in enumerate(n_runs)]
    if returns:
        slot, g = np.asarray(slots, np.int64), np.asarray(returns, np.float64)
        count = np.bincount(slot, minlength=len(slot_of))
        centred = g - (np.bincount(slot, weights=g, minlength=len(slot_of)) / count)[slot]
        credited = grpo_advantages(centred, slot, count, eps, scale)
        credited[constant_groups(g, slot, len(slot_of))[slot]] = 0.0
        for (row, k), value in zip(owner, credited):
            out[row][k] = float(value)
    return pa.array(out, pa.list_(pa.float32()))


def turn_of_tokens(mask: list[int]) -> list[int]:
    """Per token of a ``loss_mask``, the index of the run of generated tokens (1s) it is in or
    comes after; -1 before the first."""
    out, turn = [], -1
    for i, m in enumerate(mask):
        turn += m == 1 and (i == 0 or mask[i - 1] != 1)
        out.append(turn)
    return out


def count_turns(turn_of: list[int]) -> int:
    """The number of runs of generated tokens, from ``turn_of_tokens``."""
    return turn_of[-1] + 1 if turn_of else 0


def grpo_advantages(
    centred: np.ndarray, group: np.ndarray, count: np.ndarray, eps: float, scale: bool
) -> np.ndarray:
    """``centred / (std_g + eps)`` with the ddof=1 group std (0 for a group of one), or
    ``centred`` itself when ``scale`` is false. centred, group: [N]; count: [G]."""
    if not scale:
        return centred.copy()
    squares = np.bincount(group, weights=centred * centred, minlength=len(count))  # [G]
    dof = np.maximum(count - 1, 1)
    std = np.sqrt(squares / dof)  # [G]; a single sample has squares == 0
    return centred / (std[group] + eps)


def group_index(prompt_id: pa.ChunkedArray) -> tuple[np.ndarray, list[str]]:
    """Each row's group number ([N] int64, in order of first appearance) and the prompt ids."""
    encoded = pc.dictionary_encode(prompt_id).combine_chunks()
    indices = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    return indices, encoded.dictionary.to_pylist()


def constant_groups(reward: np.ndarray, group: np.ndarray, n_groups: int) -> np.ndarray:
    """[G] bool: groups whose rewards are all equal (their advantages are exactly 0)."""
    low = np.full(n_groups, np.inf)
    high = np.full(n_groups, -np.inf)
    np.minimum.at(low, group, reward)
    np.maximum.at(high, group, reward)
    return low == high


def _check_arguments(scored: pa.Table, method: str, eps: float, n_samples: int | None) -> None:
    check_columns(scored, READS, "compute_advantages")
    if "advantage" in scored.column_names:
        raise ValueError("compute_advantages: the table already has an 'advantage' column")
    if method not in METHODS:
        raise ValueError(f"compute_advantages: unknown method {method!r}; allowed: {list(METHODS)}")
    if not eps > 0:
        raise ValueError(f"compute_advantages: eps must be > 0, got {eps!r}")
    if n_samples is not None and n_samples < 1:
        raise ValueError(f"compute_advantages: n_samples must be >= 1, got {n_samples!r}")
    for name in READS.names:
        column = scored.column(name)
        if column.null_count:
            row = pc.index(pc.is_null(column), True).as_py()
            raise ValueError(f"compute_advantages: column {name!r} is null at row {row}")


def _check_rewards(reward: np.ndarray) -> None:
    with np.errstate(invalid="ignore"):
        bad = np.flatnonzero(~(np.abs(reward) <= MAX_ABS_REWARD))  # NaN, inf, huge
    if bad.size:
        raise ValueError(
            f"compute_advantages: reward is {reward[bad[0]]} at row {bad[0]}; rewards must be "
            f"finite and within {MAX_ABS_REWARD:g} (score() records failures with a fallback)"
        )


def _check_group_sizes(
    count: np.ndarray, ids: list[str], method: str, n_samples: int | None
) -> None:
    if n_samples is not None:
        wrong = np.flatnonzero(count != n_samples)
        if wrong.size:
            g = wrong[0]
            raise ValueError(
                f"compute_advantages: prompt_id {ids[g]!r} has {count[g]} samples, expected "
                f"n_samples={n_samples} ({wrong.size} groups differ); pass whole groups"
            )
    if method == "rloo":
        single = np.flatnonzero(count == 1)
        if single.size:
            shown = [ids[g] for g in single[:5]]
            raise ValueError(
                f"compute_advantages: RLOO needs at least 2 samples per prompt; prompt_id "
                f"{shown} has 1 ({single.size} such groups)"
            )


def advantage_summary(trainable: pa.Table) -> dict:
    """``{"zero_adv_groups": fraction of prompt groups whose advantages are all 0,
    "adv_abs_mean": mean |advantage|}``; both 0.0 for an empty table."""
    reads = pa.schema([TRAINABLE.field("prompt_id"), TRAINABLE.field("advantage")])
    check_columns(trainable, reads, "advantage_summary")
    if trainable.num_rows == 0:
        return {"zero_adv_groups": 0.0, "adv_abs_mean": 0.0}
    group, ids = group_index(trainable.column("prompt_id"))
    advantage = trainable.column("advantage").to_numpy().astype(np.float64)
    nonzero = np.bincount(group, weights=(advantage != 0), minlength=len(ids))
    return {
        "zero_adv_groups": float(np.mean(nonzero == 0)),
        "adv_abs_mean": float(np.mean(np.abs(advantage))),
    }
