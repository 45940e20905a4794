"""Held-out evaluation: ``evaluate`` measures held-out accuracy with greedy decoding over
``heldout_rollouts`` (which the modes bench scores prompt by prompt), the same rollout graph
as training's (``graph.rollout_graph``) under the tag ``eval``."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from rlhfless.ops.engine.engine_types import WeightsRef
from rlhfless.ops.engine.gen_stats import Generated
from rlhfless.schedulers.scaling_policy import ScalingPolicy

from ..cluster.pools import PoolCluster
from ..config import Config
from ..specs import Specs
from .graph import rollout_graph


def heldout_rollouts(pc: PoolCluster, heldout: pa.Table, weights: WeightsRef, specs: Specs,
                     cfg: Config, scaling: ScalingPolicy | None = None) -> pa.Table:
    """The scored greedy rollouts of the held-out prompts with ``weights`` (``policy``:
    predicts the work its generate tasks declare)."""
    if not pc.worker_names("gen"):  # the elastic policy may have released every one
        pc.grow("gen", 1)
    _, _, scored = rollout_graph(heldout, weights, weights.version, cfg.gen_workers, specs.eval,
                              specs.reward, seed=cfg.seed, min_prefix=cfg.min_prefix,
                              tag="eval", scaling=scaling)
    return Generated.concat(pc.client.compute(scored, optimize_graph=False, sync=True)).table


def evaluate(pc: PoolCluster, heldout: pa.Table, weights: WeightsRef, specs: Specs,
             cfg: Config, scaling: ScalingPolicy | None = None) -> dict:
    """Held-out accuracy of greedy decoding with ``weights``."""
    table = heldout_rollouts(pc, heldout, weights, specs, cfg, scaling)
    lengths = [len(r) for r in table.column("response_ids").to_pylist()]
    return {"policy_version": weights.version,
            "heldout_accuracy": float(np.mean(table.column("reward").to_numpy())),
            "heldout_response_len_mean": float(np.mean(lengths)), "heldout_n": len(table)}
