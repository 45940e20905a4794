"""The widened bench model computes what the tiny model computes (``ops/toy/benchmodel.py``)."""

from __future__ import annotations

import pytest
import torch

from rlhfless.ops.engine.backend import DTYPES
from rlhfless.ops.toy.benchmodel import BENCH_DTYPES, BENCH_SIZES, BenchSize, bench_dtype, widen


def test_widened_model_has_the_same_logits_and_more_parameters(model64):
    size = BenchSize(hidden_size=256, intermediate_size=512, num_layers=6)
    wide = widen(model64, size)
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 11]])
    with torch.no_grad():
        expected, got = model64(input_ids=ids).logits, wide(input_ids=ids).logits
    assert (got - expected).abs().max() < 1e-5  # RMSNorm runs in float32 whatever the dtype
    n_tiny = sum(p.numel() for p in model64.parameters())
    assert sum(p.numel() for p in wide.parameters()) > 3 * n_tiny
    assert wide.config.num_hidden_layers == 6 and wide.config.hidden_size == 256


def test_a_size_smaller_than_the_model_is_refused(model64):
    with pytest.raises(ValueError, match="cannot hold"):
        widen(model64, BenchSize(hidden_size=64, intermediate_size=512, num_layers=6))


def test_a_bench_model_names_its_generation_dtype():
    assert set(BENCH_DTYPES) <= set(BENCH_SIZES) and set(BENCH_DTYPES.values()) <= set(DTYPES)
    assert bench_dtype("wide64") == "float64" and bench_dtype("tiny") == "auto"
    assert BENCH_SIZES["wide64"].key() == BENCH_SIZES["wide"].key()  # one build, two dtypes
