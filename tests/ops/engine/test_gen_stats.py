"""Generation statistics travel beside the rows (``ops/engine/gen_stats.py``): typed, merged by
summing, flattened for the metrics record; the rows' schema carries nothing."""

from __future__ import annotations

import pyarrow as pa

from rlhfless.ops.engine.gen_stats import EpisodeStats, Generated, GenerationStats


def test_merge_sums_every_figure_and_the_episodes():
    a = GenerationStats(prefill_tokens=10, prefill_seconds=0.5, decode_tokens=40, decode_steps=8,
                        decode_seconds=1.0, gen_seconds=1.5, cold_start_s=2.0)
    b = GenerationStats(prefill_tokens=5, decode_tokens=6, decode_steps=3, decode_seconds=0.25,
                        gen_seconds=0.25, late_wall_s=0.1, episodes=EpisodeStats(episodes=2,
                                                                                  turns=5))
    both = a.merge(b)
    assert (both.prefill_tokens, both.decode_tokens, both.decode_steps) == (15, 46, 11)
    assert both.gen_seconds == 1.75 and both.cold_start_s == 2.0 and both.late_wall_s == 0.1
    assert both.episodes == EpisodeStats(episodes=2, turns=5)
    again = both.merge(b)
    assert again.episodes.turns == 10 and isinstance(again.decode_steps, int)
    flat = both.to_dict()
    assert flat["decode_tokens"] == 46 and flat["episodes"] == 2 and "late_wall_s" in flat
    assert "episodes" not in a.to_dict()


def test_concat_joins_rows_and_merges_statistics_without_schema_metadata():
    parts = [Generated(pa.table({"x": [1, 2]}), GenerationStats(decode_tokens=3)),
             Generated(pa.table({"x": [3]}), GenerationStats(decode_tokens=4))]
    whole = Generated.concat(parts)
    assert whole.table.column("x").to_pylist() == [1, 2, 3]
    assert whole.stats.decode_tokens == 7 and whole.table.schema.metadata is None
    scored = parts[0].with_table(parts[0].table.append_column("y", pa.array([0.5, 0.5])))
    assert scored.stats is parts[0].stats and scored.table.num_columns == 2
