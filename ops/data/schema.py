"""Arrow schemas of the tables that flow between stages.

Every stage takes and returns ``pyarrow.Table``s. A stage adds columns; it never
drops the ones it was given, so the rollout log of an iteration carries the whole
history of each sample.

    prompts   --prefix_dedup/shard-->  prompts (+ prefix_group)
    prompts   --generate-->            rollouts   (one row per (prompt, sample))
    rollouts  --reward-->              scored     (+ reward, reward_error)
    scored    --advantage-->           trainable  (+ advantage)

Multi-turn generation adds the ``EPISODES`` columns to its rollouts.
"""

from __future__ import annotations

import pyarrow as pa

# The largest |reward| a scored table holds. Larger is taken for a bug (an overflow, a sum of
# logits): past 2**53 float64 cannot tell neighbouring integers apart, and within it the
# group statistics of every advantage method stay finite.
MAX_ABS_REWARD = 1e15

PROMPTS = pa.schema(
    [
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),  # tokenised prompt
        pa.field("answer", pa.string()),  # ground truth; null when the reward needs none
        pa.field("data_source", pa.string()),  # routes to a reward function
    ]
)

ROLLOUTS = pa.schema(
    list(PROMPTS)
    + [
        pa.field("sample_idx", pa.int32(), nullable=False),
        pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_text", pa.string(), nullable=False),
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),  # behaviour policy
        pa.field("finish_reason", pa.string(), nullable=False),  # "stop" | "length"
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("worker", pa.string(), nullable=False),
        pa.field("gen_start", pa.float64(), nullable=False),  # unix seconds
        pa.field("gen_end", pa.float64(), nullable=False),
    ]
)

SCORED = pa.schema(
    list(ROLLOUTS)
    + [
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("reward_error", pa.string()),  # null when the reward function succeeded
    ]
)

TRAINABLE = pa.schema(list(SCORED) + [pa.field("advantage", pa.float32(), nullable=False)])

FINISH_REASONS = ("stop", "length")

# Multi-turn rollouts (ops/rollouts/episode.py) append these to ROLLOUTS. ``response_ids`` is then
# the whole trajectory after the prompt: each turn's ids as generated, each observation's ids as
# tokenized, in order; ``loss_mask`` is 1 on generated tokens and 0 on observation tokens,
# whose ``logprobs`` are 0 (no behaviour policy produced them). The update trains on the
# tokens of ``loss_mask`` only. ``finish_reason`` adds "turns" (max turns reached) and "error"
# (the environment failed; ``env_error`` says how).
EPISODES = pa.schema(
    [
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("turns", pa.int32(), nullable=False),
        # sum of the steps' rewards and close()'s final reward
        pa.field("env_reward", pa.float64(), nullable=False),
        pa.field("turn_rewards", pa.list_(pa.float64()), nullable=False),  # each step's
        pa.field("env_error", pa.string()),  # null when every environment call succeeded
        pa.field("env_seconds", pa.float64(), nullable=False),  # inside environment calls
    ]
)
EPISODE_FINISH_REASONS = (*FINISH_REASONS, "turns", "error")


def check_columns(table: pa.Table, schema: pa.Schema, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` if ``table`` lacks a column of ``schema``
    or holds it with another type."""
    for field in schema:
        if field.name not in table.column_names:
            raise ValueError(
                f"{where}: missing column {field.name!r}; expected columns {schema.names}"
            )
        got = table.schema.field(field.name).type
        if got != field.type:
            raise ValueError(
                f"{where}: column {field.name!r} has type {got}, expected {field.type}"
            )


def conform(table: pa.Table, schema: pa.Schema, where: str) -> pa.Table:
    """Cast ``table``'s columns of ``schema`` to their declared types, keeping extra
    columns after them; a clear ``ValueError`` if a column is missing or will not cast."""
    columns, fields = [], []
    for field in schema:
        if field.name not in table.column_names:
            raise ValueError(
                f"{where}: missing column {field.name!r}; expected columns {schema.names}"
            )
        try:
            columns.append(table.column(field.name).cast(field.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
            raise ValueError(
                f"{where}: column {field.name!r} cannot be {field.type}: {err}"
            ) from err
        fields.append(field)
    for name in table.column_names:
        if name not in schema.names:
            columns.append(table.column(name))
            fields.append(table.schema.field(name))
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))
