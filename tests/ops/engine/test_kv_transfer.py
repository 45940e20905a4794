"""A paused tail exported and imported (``ops/engine/kv_transfer.py``) decodes on as if never
paused: same tokens under greedy decoding and under sampling (each sequence's draws are
keyed by the sequence, ``ops/engine/seeds.py``), same behaviour log-probabilities, in float64."""

from __future__ import annotations

import pickle

import pyarrow as pa
import pytest
import torch

from rlhfless.ops.data.prefix_dedup import plan_prefixes
from rlhfless.ops.engine.engine_types import SamplingParams
from rlhfless.ops.engine.generate import decode, prefill_prompts, run_decoding
from rlhfless.ops.engine.kv_transfer import (
    export_tail,
    import_tail,
    recompute_tail,
    split_tail,
    take_tail,
)
from rlhfless.ops.engine.rows import expand_samples
from rlhfless.ops.toy.tinytask import make_prompt

N_SAMPLES = 3
TEXTS = [make_prompt(["fig", "pear"]), make_prompt(["rose", "lily", "oat", "rye"]),
         "Items: oat rye\nAnswer: 1 oat", "honey"]


@pytest.fixture(scope="module")
def shard(make_prompts):
    plan = plan_prefixes(make_prompts(TEXTS), n_samples=N_SAMPLES)
    return plan.prompts


def _uninterrupted(model, tokenizer, shard, params):
    return decode(model, shard.column("prompt_ids").to_pylist(), N_SAMPLES, params,
                  tokenizer.eos_token_id, tokenizer.pad_token_id,
                  shard.column("prefix_len").to_pylist())


def _paused(model, tokenizer, shard, params, until: float):
    ids = shard.column("prompt_ids").to_pylist()
    dec = prefill_prompts(model, ids, N_SAMPLES, params, tokenizer.pad_token_id,
                          shard.column("prefix_len").to_pylist())
    return run_decoding(model, dec, params, tokenizer.eos_token_id, until_finished=until)


@pytest.mark.parametrize("greedy", [True, False])
def test_continuation_after_transfer_equals_uninterrupted(eos64, tokenizer, shard, greedy):
    params = SamplingParams(max_new_tokens=40, temperature=0.8, greedy=greedy, seed=3)
    whole = _uninterrupted(eos64, tokenizer, shard, params)
    dec = _paused(eos64, tokenizer, shard, params, until=0.25)
    tail = dec.live.tolist()
    assert 0 < len(tail) < len(whole)  # a real pause: some finished, some not
    rows = shard.take([i // N_SAMPLES for i in range(len(whole))])
    sent = pickle.loads(pickle.dumps(export_tail(dec, rows, 0.0)))  # what Dask ships
    assert sent.context_tokens == int(dec.mask.sum()) and sent.nbytes > 0
    moved, _ = import_tail(eos64, [sent])
    run_decoding(eos64, moved, params, tokenizer.eos_token_id)
    for seq, (ids, lps, reason) in zip(tail, moved.results()):
        assert ids == whole[seq][0] and reason == whole[seq][2]
        assert torch.allclose(torch.tensor(lps), torch.tensor(whole[seq][1]), atol=1e-9)


def test_two_tails_merged_decode_as_before_under_greedy(eos64, tokenizer, shard):
    """PAT's consolidation: two workers' tails continue as one batch."""
    params = SamplingParams(max_new_tokens=40, greedy=True)
    halves = [shard.slice(0, 2), shard.slice(2)]
    expected, tails = [], []
    for half in halves:
        expected += _uninterrupted(eos64, tokenizer, half, params)
        dec = _paused(eos64, tokenizer, half, params, until=0.2)
        offset = len(expected) - len(half) * N_SAMPLES
        rows = half.take([i // N_SAMPLES for i in range(len(half) * N_SAMPLES)])
        tails.append((export_tail(dec, rows, 0.0), [offset + s for s in dec.live.tolist()]))
    merged, rows = import_tail(eos64, [t for t, _ in tails])
    assert len(rows) == merged.live.numel() == sum(len(s) for _, s in tails)
    run_decoding(eos64, merged, params, tokenizer.eos_token_id)
    for seq, (ids, lps, _) in zip([s for _, seqs in tails for s in seqs], merged.results()):
        assert ids == expected[seq][0]
        assert torch.allclose(torch.tensor(lps), torch.tensor(expected[seq][1]), atol=1e-9)


def test_a_tail_split_over_two_targets_decodes_as_before_under_greedy(eos64, tokenizer,
                                                                        shard):
    """A tail spread over several workers: each part (``take_tail``) continues alone."""
    params = SamplingParams(max_new_tokens=40, greedy=True)
    whole = _uninterrupted(eos64, tokenizer, shard, params)
    dec = _paused(eos64, tokenizer, shard, params, until=0.25)
    live = dec.live.tolist()
    assert len(live) >= 2
    rows = shard.take([i // N_SAMPLES for i in range(len(whole))])
    tail = export_tail(dec, rows, 0.0)
    odd, even = list(range(1, len(live), 2)), list(range(0, len(live), 2))
    for part in (odd, even):
        piece = take_tail(tail, part)
        assert piece.n_sequences == len(part) and piece.nbytes < tail.nbytes
        moved, _ = import_tail(eos64, [piece])
        run_decoding(eos64, moved, params, tokenizer.eos_token_id)
        for p, (ids, lps, _) in zip(part, moved.results()):
            assert ids == whole[live[p]][0]
            assert torch.allclose(torch.tensor(lps), torch.tensor(whole[live[p]][1]), atol=1e-9)
    with pytest.raises(ValueError, match="take_tail"):
        take_tail(tail, [len(live)])


def test_a_tail_shed_in_part_decodes_as_before_on_both_sides(eos64, tokenizer, shard):
    """``split_tail``: the shed sequences continue elsewhere, the others where they were
    (the same paused batch, narrowed); both equal uninterrupted decoding (sampled)."""
    params = SamplingParams(max_new_tokens=40, temperature=0.8, seed=5)
    whole = _uninterrupted(eos64, tokenizer, shard, params)
    dec = _paused(eos64, tokenizer, shard, params, until=0.25)
    live = dec.live.tolist()
    assert len(live) >= 3
    rows = shard.take([i // N_SAMPLES for i in range(len(whole))])
    shed = [len(live) - 1, 0]
    sent = pickle.loads(pickle.dumps(split_tail(dec, rows, 0.0, shed)))
    assert sent.n_sequences == 2 and dec.live.tolist() == live[1:-1]
    assert dec.cache.layers[0].keys.shape[0] == len(live) - 2
    moved, _ = import_tail(eos64, [sent])
    for batch, seqs in ((moved, [live[p] for p in shed]), (dec, live[1:-1])):
        results = run_decoding(eos64, batch, params, tokenizer.eos_token_id).results()
        got = results if batch is moved else [results[s] for s in seqs]
        for seq, (ids, lps, reason) in zip(seqs, got):
            assert ids == whole[seq][0] and reason == whole[seq][2]
            assert torch.allclose(torch.tensor(lps), torch.tensor(whole[seq][1]), atol=1e-9)
    for bad in ([], [0, 0], [len(live)]):
        with pytest.raises(ValueError, match="split_tail"):
            split_tail(_paused(eos64, tokenizer, shard, params, until=0.25), rows, 0.0, bad)


def test_import_of_nothing_is_refused(eos64):
    with pytest.raises(ValueError, match="no sequences"):
        import_tail(eos64, [])


def test_recomputed_tail_continues_like_the_transferred_one(eos64, tokenizer, shard):
    """The recompute path (``recompute_tail``) ends in the same tokens under greedy."""
    params = SamplingParams(max_new_tokens=40, greedy=True)
    dec = _paused(eos64, tokenizer, shard, params, until=0.25)
    tail = dec.live.tolist()
    every = expand_samples(shard, N_SAMPLES)
    cut = every.take(tail).append_column("partial_ids", pa.array([dec.tokens[s] for s in tail]))
    cut = cut.append_column("partial_logprobs", pa.array([dec.logprobs[s] for s in tail]))
    sent = export_tail(dec, every, 0.0)
    redone = recompute_tail(eos64, cut, params, tokenizer.pad_token_id)
    assert redone.context_tokens == sent.context_tokens
    results = []
    for tails in ([sent], [redone]):
        moved, _ = import_tail(eos64, tails)
        results.append(run_decoding(eos64, moved, params, tokenizer.eos_token_id).results())
    for (ids, lps, _), (ids2, lps2, _) in zip(*results):
        assert ids == ids2
        assert torch.allclose(torch.tensor(lps), torch.tensor(lps2), atol=1e-9)
