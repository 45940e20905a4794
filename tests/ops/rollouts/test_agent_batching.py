"""The endpoint's batches (``agent_server.py``): requests of concurrent episodes decode in one
engine call, and each is answered as soon as its sample leaves the batch, not when the
batch's last sample does."""

from __future__ import annotations

import threading

import openai

from rlhfless.ops.engine.engine_types import SamplingParams
from rlhfless.ops.engine.gen_stats import GenerationStats

ASK = [{"role": "user", "content": "Items: fig pear plum\nHow many items?"}]


def test_a_short_request_is_answered_while_its_batch_still_decodes(server, engine):
    server.set_engine(engine, SamplingParams(max_new_tokens=64, seed=3), None)
    server.concurrency = 2  # the dispatcher waits for both episodes' requests: one batch
    server.stats = stats = GenerationStats()
    tokens = [server.open_episode(k) for k in (1, 2)]
    busy_before, seen = server.busy_s, {}

    def ask(token: str, max_tokens: int) -> None:
        client = openai.OpenAI(base_url=server.base_url, api_key=token, max_retries=0,
                               timeout=60)
        client.chat.completions.create(model="m", messages=ASK, max_tokens=max_tokens)
        # busy_s grows when the engine call returns: unchanged, the batch was still decoding
        seen[max_tokens] = server.busy_s

    threads = [threading.Thread(target=ask, args=(t, m)) for t, m in zip(tokens, (1, 64))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    short, long = (server.close_episode(t) for t in tokens)
    assert len(short[0].samples[0][0]) == 1
    # the long one decoded on for 31+ steps (this seed draws 45 tokens), tens
    # of milliseconds at least, while an answer takes a loopback round trip
    assert len(long[0].samples[0][0]) >= 32
    assert stats.decode_steps == len(long[0].samples[0][0])  # one engine call for both
    assert seen[1] == busy_before  # the short one was answered before that call returned
