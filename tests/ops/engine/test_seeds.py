"""One seed rule (``ops/engine/seeds.py``): a (prompt, sample) draws the same response under
sampling whichever shard it is generated in, whether its batch was cut and its tail resumed,
recomputed elsewhere, or moved with its KV cache and split (float64, so that the batch's
composition cannot flip a draw)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from rlhfless.ops.data.prefix_dedup import plan_prefixes
from rlhfless.ops.engine.engine_types import SamplingParams
from rlhfless.ops.engine.generate import (
    generate_rollouts,
    prefill_continuations,
    prefill_prompts,
    run_decoding,
)
from rlhfless.ops.engine.kv_transfer import export_tail, import_tail, take_tail
from rlhfless.ops.engine.rows import expand_samples, prefix_lens_of, row_keys
from rlhfless.ops.engine.seeds import generation_seed, sequence_keys, uniforms
from rlhfless.ops.toy.tinytask import make_prompt

N = 3
TEXTS = [make_prompt(["fig", "pear"]), make_prompt(["rose", "lily", "oat", "rye"]),
         make_prompt(["oat"]), "Items: oat rye\nAnswer: 1 oat", "honey", make_prompt(["jam"])]
PARAMS = SamplingParams(max_new_tokens=30, temperature=1.0, seed=generation_seed(11, 3))


def _by_pair(rows: pa.Table, results) -> dict:
    return {(p, s): r[0] for p, s, r in zip(rows.column("prompt_id").to_pylist(),
                                            rows.column("sample_idx").to_pylist(), results)}


def _static(model, tokenizer, prompts) -> dict:
    table, _ = generate_rollouts(model, tokenizer, prompts, N, PARAMS, policy_version=0)
    return _by_pair(table, [(r,) for r in table.column("response_ids").to_pylist()])


def _cut(model, tokenizer, shard):
    """A chunk paused at a third finished: (finished pairs, the paused decoding, its rows)."""
    rows = expand_samples(shard, N)
    dec = prefill_prompts(model, shard.column("prompt_ids").to_pylist(), N, PARAMS,
                          tokenizer.pad_token_id, prefix_lens_of(shard, True), None,
                          row_keys(PARAMS.seed, rows))
    run_decoding(model, dec, PARAMS, tokenizer.eos_token_id, until_finished=0.3)
    live = set(dec.live.tolist())
    assert 0 < len(live) < len(rows)  # a real pause
    done = [i for i in range(len(rows)) if i not in live]
    results = dec.results()
    return _by_pair(rows.take(done), [results[i] for i in done]), dec, rows


def test_static_and_elastic_generation_draw_the_same_samples(eos64, make_prompts, tokenizer):
    """Static: one shard, decoded whole. Elastic: other shards; one tail resumed in place,
    one recomputed on another worker, one moved with its KV cache and split in two."""
    prompts = plan_prefixes(make_prompts(TEXTS), n_samples=N).prompts
    static = _static(eos64, tokenizer, prompts)
    eos = tokenizer.eos_token_id
    elastic = {}
    shards = [prompts.take([4, 0]), prompts.take([1, 5]), prompts.take([3, 2])]
    for way, shard in zip(("resume", "recompute", "transfer"), shards):
        done, dec, rows = _cut(eos64, tokenizer, shard)
        elastic |= done
        live = dec.live.tolist()
        if way == "resume":
            run_decoding(eos64, dec, PARAMS, eos)
            results = dec.results()
            elastic |= _by_pair(rows.take(live), [results[i] for i in live])
        elif way == "recompute":
            cut = rows.take(live).append_column("partial_ids", pa.array(
                [dec.tokens[i] for i in live], pa.list_(pa.int32()))).append_column(
                "partial_logprobs", pa.array([dec.logprobs[i] for i in live],
                                             pa.list_(pa.float32())))
            moved = prefill_continuations(eos64, cut, PARAMS, tokenizer.pad_token_id)
            elastic |= _by_pair(cut, run_decoding(eos64, moved, PARAMS, eos).results())
        else:
            tail = export_tail(dec, rows, 0.0)
            for part in (list(range(0, len(live), 2)), list(range(1, len(live), 2))):
                if part:
                    moved, part_rows = import_tail(eos64, [take_tail(tail, part)])
                    elastic |= _by_pair(part_rows,
                                        run_decoding(eos64, moved, PARAMS, eos).results())
    assert elastic.keys() == static.keys() and len(static) == len(TEXTS) * N
    for pair, ids in static.items():
        assert elastic[pair] == ids, pair
    samples = list(static.values())
    assert len({tuple(s) for s in samples}) > len(TEXTS)  # the samples of a prompt differ


def test_another_iteration_draws_other_samples(model, make_prompts, tokenizer):
    prompts = make_prompts(TEXTS[:3])
    again = SamplingParams(**{**PARAMS.__dict__, "seed": generation_seed(11, 4)})
    first, _ = generate_rollouts(model, tokenizer, prompts, N, PARAMS, policy_version=0)
    other, _ = generate_rollouts(model, tokenizer, prompts, N, again, policy_version=0)
    assert first.column("response_ids").to_pylist() != other.column("response_ids").to_pylist()


def test_keys_and_uniforms_are_stable_and_spread():
    keys = sequence_keys(5, ["a", "a", "b"], [0, 1, 0])
    assert len(set(keys.tolist())) == 3
    assert (keys == sequence_keys(5, ["a", "a", "b"], [0, 1, 0])).all()
    assert generation_seed(5, 1) != generation_seed(5, 2) != generation_seed(6, 1)
    u = uniforms(np.repeat(keys, 4000), np.tile(np.arange(4000, dtype=np.uint64), 3))
    assert 0.0 <= u.min() and u.max() < 1.0
    assert u.mean() == pytest.approx(0.5, abs=0.01) and u.std() == pytest.approx(12**-0.5,
                                                                                 abs=0.01)
