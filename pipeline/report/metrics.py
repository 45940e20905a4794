"""Per-iteration metrics, computed from the tables and task timings an iteration produced.

Stage seconds come from Dask's own task stream (each task's compute start and stop on its
worker), grouped by the stage of the key (``task_keys.stage_of``: ``generate-3-1`` →
``generate``; Dask's own tasks left out): ``wall`` is first start to last stop, ``busy`` the
sum over that stage's tasks.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
import pyarrow as pa

from rlhfless.ops.algo.advantage import advantage_summary
from rlhfless.ops.engine.gen_stats import Generated
from rlhfless.ops.rollouts.reward import reward_error_counts, reward_summary

from ..task_keys import stage_of


def rollout_metrics(scored: pa.Table) -> dict:
    """Reward and response-length statistics of a scored (or trainable) table."""
    lengths = np.array([len(r) for r in scored.column("response_ids").to_pylist()], float)
    out = reward_summary(scored) | reward_error_counts(scored)
    if len(lengths):
        mean = float(lengths.mean())
        out |= {
            "response_len_mean": mean,
            "response_len_p50": float(np.percentile(lengths, 50)),
            "response_len_p90": float(np.percentile(lengths, 90)),
            "response_len_max": float(lengths.max()),
            "response_len_cv": float(lengths.std() / mean) if mean else 0.0,
            "finished_frac": float(np.mean(
                np.array(scored.column("finish_reason").to_pylist()) == "stop")),
        }
    if "turns" in scored.column_names and len(scored):  # multi-turn episodes
        reasons = scored.column("finish_reason").to_pylist()
        out |= {"turns_mean": float(np.mean(scored.column("turns").to_numpy())),
                **{f"episodes_{r}": reasons.count(r) for r in sorted(set(reasons))}}
    if "advantage" in scored.column_names:
        out |= advantage_summary(scored)
    return out


def iteration_record(iteration: int, version: int, started: float, plan,
                     trainables: list[Generated], update: dict,
                     stream: list[dict]) -> tuple[dict, pa.Table]:
    """The metrics record of one iteration that trained policy ``version`` on the shards
    ``trainables`` (their generation statistics summed, the dedup ``plan``'s prefill
    figures beside the engines' own, stage seconds from the task ``stream``), and the shards
    as one table."""
    whole = Generated.concat(trainables)
    table, gen = whole.table, whole.stats.to_dict()
    record = {
        "iteration": iteration, "policy_version": version, "time": time.time(),
        "iteration_s": time.time() - started, "samples": len(table),
        # the longest shard's generation seconds (its pieces summed): generation's share of
        # the iteration's critical path
        "gen_path_s": max((t.stats.gen_seconds for t in trainables), default=0.0),
        "prefill_tokens_naive": plan.naive_prefill_tokens,
        "prefill_tokens_planned": plan.planned_prefill_tokens,
        **prefill_figures(gen), **gen, **rollout_metrics(table), **update,
        **stage_seconds(stream),
    }
    return record, table


def prefill_figures(gen: dict) -> dict:
    """What prefill cost, as the engines counted it: ``prefill_tokens_saved`` the prompt
    tokens whose KV was there already (prefixes shared, conversations kept across turns and
    agent requests), ``prefill_tokens_per_request`` the tokens each sequence's prompt
    (a sample's, a turn's, an agent request's) ran through the model."""
    requests = gen.get("prefill_requests", 0)
    return {"prefill_tokens_saved": gen.get("prefill_reused_tokens", 0),
            "prefill_tokens_per_request": gen.get("prefill_tokens", 0) / requests
            if requests else 0.0}


def stage_seconds(task_stream: list[dict]) -> dict:
    """``{"<stage>_wall_s": ..., "<stage>_busy_s": ...}`` from ``get_task_stream`` records."""
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for task in task_stream:
        stage = stage_of(task["key"])
        for ss in task.get("startstops", ()) if stage is not None else ():
            if ss.get("action") == "compute":
                spans[stage].append((ss["start"], ss["stop"]))
    out = {}
    for stage, intervals in sorted(spans.items()):
        out[f"{stage}_wall_s"] = max(b for _, b in intervals) - min(a for a, _ in intervals)
        out[f"{stage}_busy_s"] = sum(b - a for a, b in intervals)
    return out
