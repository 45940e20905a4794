"""The phases the transformers engine records (``ops/engine/phases.py``): a prefill span with
its tokens, decode spans whose tokens add up to the run's ``decode_tokens``, one after
another inside the run, and a ``pause`` where decoding stops at the stop rule."""

from __future__ import annotations

import time

import pytest

from rlhfless.ops.engine import phases
from rlhfless.ops.engine.engine_types import SamplingParams
from rlhfless.ops.engine.gen_stats import GenerationStats
from rlhfless.ops.engine.generate import generate_rollouts, prefill_prompts, run_decoding

TEXTS = ["Items: oat rye\nAnswer:", "Items: fig\nAnswer:", "honey"]


@pytest.fixture
def recorded():
    """The phases recorded while the test runs, as (name, t0, t1, args)."""
    got: list[tuple] = []
    phases.set_sink(lambda *phase: got.append(phase))
    yield got
    phases.set_sink(None)


@pytest.mark.parametrize("span_s", [phases.DECODE_SPAN_S, 0.0])
def test_decode_spans_add_up_to_the_runs_tokens(model, tokenizer, make_prompts, recorded,
                                                monkeypatch, span_s):
    monkeypatch.setattr(phases, "DECODE_SPAN_S", span_s)  # 0: a span per step
    started = time.time()
    _, stats = generate_rollouts(model, tokenizer, make_prompts(TEXTS), 3,
                                 SamplingParams(max_new_tokens=8, seed=1), policy_version=0)
    ended = time.time()
    names = [name for name, *_ in recorded]
    assert names[0] == "prefill" and set(names[1:]) == {"decode"}
    assert recorded[0][3]["tokens"] == stats.prefill_tokens > 0
    decode = [(t1 - t0, args) for name, t0, t1, args in recorded if name == "decode"]
    assert sum(a["tokens"] for _, a in decode) == stats.decode_tokens > 0
    assert sum(a["steps"] for _, a in decode) == stats.decode_steps > 1
    assert all(seconds >= span_s for seconds, _ in decode[:-1])  # closed once that long
    assert span_s or len(decode) == stats.decode_steps
    times = [t for _, t0, t1, _ in recorded for t in (t0, t1)]
    assert times == sorted(times) and started <= times[0] and times[-1] <= ended


@pytest.mark.parametrize("until, pause, by",
                         [(0.0, None, "tau"), (1.0, lambda: True, "interrupted")])
def test_a_stop_at_the_rule_is_a_pause(model, tokenizer, recorded, until, pause, by):
    params = SamplingParams(max_new_tokens=8, seed=1)
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    stats = GenerationStats()
    dec = prefill_prompts(model, ids, 2, params, tokenizer.pad_token_id, stats=stats)
    run_decoding(model, dec, params, -1, stats, until_finished=until, pause=pause)
    assert [name for name, *_ in recorded] == ["prefill", "decode", "pause"]
    _, t0, t1, args = recorded[-1]
    assert t0 == t1 and args == {"live": len(dec.live), "finished": 0.0, "by": by}
    assert len(dec.live) == 2 * len(TEXTS) and stats.decode_steps == 1
    run_decoding(model, dec, params, -1, stats)  # resumed: decodes to the end, no pause
    assert [name for name, *_ in recorded[3:]] == ["decode"]
    assert sum(a.get("tokens", 0) for n, _, _, a in recorded if n == "decode") == \
        stats.decode_tokens == 2 * len(TEXTS) * 8
