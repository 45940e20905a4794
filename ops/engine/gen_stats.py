"""What generating rows cost, returned beside the rows: ``GenerationStats``, ``Generated``.

A generation task returns its rollouts as an Arrow table and the statistics of the run that
made them as a ``GenerationStats`` (typed fields; ``merge`` adds up pieces of a shard or the
shards of a batch; ``to_dict`` is what the metrics record gets), together a ``Generated``.
The reward and advantage tasks pass the statistics on unchanged beside the table they add
columns to, so the tables keep to their schemas (``schema.py``) and carry no side data. The
engines count into the same object as they prefill and decode. No torch here: the emulated
backend uses it too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

import pyarrow as pa


@dataclass
class EpisodeStats:
    """Multi-turn rollouts (``episode.py``): what the environments did and cost."""

    episodes: int = 0
    turns: int = 0
    env_calls: int = 0  # construction, reset, steps and close
    env_errors: int = 0  # episodes ended by an environment failure
    env_seconds: float = 0.0  # summed over episodes, inside environment calls
    env_wait_seconds: float = 0.0  # the engine decoded nothing, waiting on environments/agents
    observation_tokens: int = 0

    def merge(self, other: EpisodeStats) -> EpisodeStats:
        return EpisodeStats(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                               for f in dataclasses.fields(self)})

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class GenerationStats:
    """A generation run's counters (the engine's) and the task's own figures."""

    prefill_tokens: int = 0  # prompt tokens that went through the model
    # prompt tokens whose KV was there already (a shared prefix computed once, a
    # conversation's KV kept from its last turn or request): not run again
    prefill_reused_tokens: int = 0
    prefill_requests: int = 0  # sequences whose prompt the engine took (sample, turn, request)
    prefill_seconds: float = 0.0
    # a moved KV cache's transfer and load, where the engine times it on its own clock (the
    # emulated engine's profile); 0 where the caller times it on the wall
    kv_load_seconds: float = 0.0
    decode_tokens: int = 0  # sampled tokens (sum over steps of the live batch size)
    decode_steps: int = 0
    decode_seconds: float = 0.0
    gen_seconds: float = 0.0  # the task's generation seconds (emulated: emulated seconds)
    cold_start_s: float = 0.0  # the engine load this task paid
    weight_fetch_s: float = 0.0  # getting a newer policy version into the engine first
    late_wall_s: float = 0.0  # emulated tasks: wall seconds past their emulated duration
    episodes: EpisodeStats | None = None  # multi-turn rollouts

    def merge(self, other: GenerationStats) -> GenerationStats:
        """The statistics of both runs together: every figure summed."""
        both = [s for s in (self.episodes, other.episodes) if s is not None]
        counts = {f.name: getattr(self, f.name) + getattr(other, f.name)
                  for f in dataclasses.fields(self) if f.name != "episodes"}
        episodes = both[0].merge(both[1]) if len(both) == 2 else (both or [None])[0]
        return GenerationStats(**counts, episodes=episodes)

    def to_dict(self) -> dict[str, float]:
        """Flat figures for the metrics record (the episodes' figures under their names)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "episodes"}
        return out | (self.episodes.as_dict() if self.episodes is not None else {})


@dataclass
class Generated:
    """Rows of a shard (rollouts, later scored, then trainable) and the statistics of the
    generation that made them."""

    table: pa.Table
    stats: GenerationStats = field(default_factory=GenerationStats)

    def __len__(self) -> int:
        return self.table.num_rows

    def with_table(self, table: pa.Table) -> Generated:
        """``table`` (these rows with columns added) beside the same statistics."""
        return Generated(table, self.stats)

    @staticmethod
    def concat(parts: Iterable[Generated]) -> Generated:
        """The rows of ``parts`` as one table, their statistics merged."""
        parts = list(parts)
        stats = GenerationStats()
        for part in parts:
            stats = stats.merge(part.stats)
        return Generated(pa.concat_tables([p.table for p in parts]), stats)
