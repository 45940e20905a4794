"""A live run's elastic policy prices weights at its model's size: ``build_run`` gives the
policy a cold start and a per-version fetch from ``WeightCosts`` on the model's parameters
(counted from its config on the meta device) at the engine's dtype and the configured rates,
and the same work then gets another worker count at Qwen2.5-0.5B's dims than on the tiny
model, while a rank-16 LoRA run of the 0.5B model, sending its adapter alone, gets the tiny
model's."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoModelForCausalLM, Qwen2Config

from rlhfless.ops.engine.lora import LoraSpec
from rlhfless.pipeline.config import Config
from rlhfless.pipeline.durable.runs import RunDir
from rlhfless.pipeline.train.build import build_run, scaling_policy

QWEN_05B = 494_032_768  # Qwen2.5-0.5B's parameters, tied embeddings once
# rank-16 adapters on q, k, v, o of its 24 layers: r * (in + out) each, hidden 896, kv 128
ADAPTER = 24 * 16 * ((896 + 896) + 2 * (896 + 128) + (896 + 896))
GROUPS, SAMPLES, LENGTH = 32, 8, 512  # the work: 32 groups of 8 samples of 512 tokens
A, C = 0.02, 1e-4  # the throughput model's decode priors: a step is a + c * live batch


@pytest.fixture(scope="module")
def qwen_05b_dir(tmp_path_factory):
    """Qwen2.5-0.5B's published config alone: the policy reads no weights."""
    path = tmp_path_factory.mktemp("qwen05b")
    Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                max_position_embeddings=32768, tie_word_embeddings=True).save_pretrained(path)
    return path


def _plan(policy):
    return policy.plan(np.full(GROUPS, float(LENGTH)), np.full(GROUPS, float(LENGTH)),
                       SAMPLES, np.zeros(GROUPS), keep_warm=8, max_workers=8)


def test_a_run_prices_its_own_model(tiny_model_dir, tmp_path):
    """The run's policy, as ``build_run`` makes it: fp32 on CPU at the default 1 GB/s, the
    tiny model's loaded parameters in its fetch, plus the 30 s engine start in its cold
    start."""
    cfg = Config(model=str(tiny_model_dir), policy="elastic", device="cpu")
    (tmp_path / "run").mkdir()
    throughput = build_run(cfg, RunDir(tmp_path / "run"), log=lambda *_: None).scaling.throughput
    params = AutoModelForCausalLM.from_pretrained(tiny_model_dir).num_parameters()
    assert throughput.weight_fetch_s == pytest.approx(params * 4 / 1e9, rel=1e-12)
    assert throughput.cold_start_s == pytest.approx(30.0 + params * 4 / 1e9, rel=1e-12)


def test_a_05b_run_starts_fewer_workers_than_a_tiny_one(tiny_model_dir, qwen_05b_dir):
    """Eight warm workers, the same work and rates: the tiny model's fetch is 3 ms and two
    workers score best; at 0.5B each busy worker fetches 1.98 GB (1.98 s) per version and
    one does. A rank-16 adapter (8.7 MB) costs 8.7 ms and keeps the tiny model's two."""
    cfg = Config(policy="elastic", device="cpu")
    real = scaling_policy(cfg, qwen_05b_dir, None)
    assert real.throughput.weight_fetch_s == pytest.approx(QWEN_05B * 4 / 1e9, rel=1e-12)
    lora = scaling_policy(cfg, qwen_05b_dir, LoraSpec(16, 16.0))
    assert lora.throughput.weight_fetch_s == pytest.approx(ADAPTER * 4 / 1e9, rel=1e-12)
    assert lora.throughput.cold_start_s == real.throughput.cold_start_s  # the base, whole
    tiny, real, lora = (_plan(p) for p in (scaling_policy(cfg, tiny_model_dir, None),
                                           real, lora))
    assert (tiny.n_workers, real.n_workers, lora.n_workers) == (2, 1, 2)
    decode_s = A * LENGTH + C * GROUPS * SAMPLES * LENGTH  # one worker decodes it all
    np.testing.assert_allclose(real.worker_seconds, [decode_s + QWEN_05B * 4 / 1e9],
                               rtol=1e-12)
