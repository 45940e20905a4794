"""What holding the policy costs a generation worker, priced at the run's model size.

A worker that joins the pool reads the base weights (its cold start); every worker that
generates in an iteration first fetches that iteration's policy version: the full weights,
or a LoRA run's adapter alone. Both are bytes over a measured rate (``bench/weights.py``
measures this machine's: file read and memory copy, GB/s), so the scaling policy's priors
follow the model: a 0.5B model's cold start and fetch are seconds where a tiny model's are
milliseconds, and the cheapest worker count moves with them. ``WeightCosts.throughput``
builds the ``ThroughputModel`` whose priors they are; measured cold starts replace its
prior as the run reports them (``ScalingPolicy.observe_cold_starts``).

Simplifications: a fetch does not overlap generation; the engine's own start (process,
framework import, engine build) is one measured figure, whatever the model's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .throughput import ThroughputModel

GB = 1e9  # bytes; the rates are decimal GB/s, as bandwidths are quoted


@dataclass(frozen=True)
class WeightCosts:
    """A model's bytes and the rates they move at (measured on the run's machines)."""

    model_bytes: float  # the base weights a cold worker loads (parameters x bytes each)
    version_bytes: float  # what a version sends: the full weights, or the adapter alone
    load_gbs: float  # measured: base weights read into an engine, GB/s
    fetch_gbs: float  # measured: a version's publish + fetch, GB/s end to end
    engine_start_s: float = 0.0  # measured: a cold start's part that is not the weights

    def __post_init__(self) -> None:
        for key in ("model_bytes", "version_bytes", "engine_start_s"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"WeightCosts: {key} = {getattr(self, key)!r} must be >= 0")
        for key in ("load_gbs", "fetch_gbs"):
            if not getattr(self, key) > 0:
                raise ValueError(f"WeightCosts: {key} = {getattr(self, key)!r} must be > 0")

    @classmethod
    def of_model(cls, params: float, bytes_per_param: float, load_gbs: float,
                 fetch_gbs: float, engine_start_s: float = 0.0,
                 adapter_params: float | None = None) -> WeightCosts:
        """Costs of a model of ``params`` parameters stored at ``bytes_per_param`` (4: fp32,
        2: bf16); a LoRA run sends its ``adapter_params`` alone per version."""
        sent = params if adapter_params is None else adapter_params
        return cls(params * bytes_per_param, sent * bytes_per_param, load_gbs, fetch_gbs,
                   engine_start_s)

    @property
    def cold_start_s(self) -> float:
        """Seconds from a worker's start to its engine holding the base weights."""
        return self.engine_start_s + self.model_bytes / (self.load_gbs * GB)

    @property
    def fetch_s(self) -> float:
        """Seconds for a worker to get one version into its engine."""
        return self.version_bytes / (self.fetch_gbs * GB)

    def throughput(self, **priors: Any) -> ThroughputModel:
        """A ``ThroughputModel`` with these cold start and fetch seconds (and ``priors``,
        its other keyword arguments)."""
        return ThroughputModel(cold_start_s=self.cold_start_s, weight_fetch_s=self.fetch_s,
                               **priors)
