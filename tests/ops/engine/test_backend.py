"""The generation backend protocol: the hf backend is the decode loop, unchanged. The vllm
backend runs on a real vLLM engine in ``test_vllm_backend.py``; only its colocated path
(sleep / wake around a weight update), which needs CUDA, is checked here against a
stand-in for ``vllm.LLM`` that records what it is asked."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass

import pyarrow as pa
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from rlhfless.ops.data.load import read_prompts
from rlhfless.ops.data.schema import ROLLOUTS, check_columns
from rlhfless.ops.engine.backend import GenerationBackend, HFBackend
from rlhfless.ops.engine.engine_types import EngineSpec, SamplingParams, WeightsRef
from rlhfless.ops.engine.generate import generate_rollouts
from rlhfless.ops.engine.publish import publish_weights
from rlhfless.ops.engine.registry import engine_class, engine_names, make_engine
from rlhfless.ops.engine.vllm_backend import VLLMBackend

PARAMS = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir) -> pa.Table:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return read_prompts(tiny_model_dir / "train.jsonl", tok).table.slice(0, 5)


@pytest.fixture(scope="module")
def hf(tiny_model_dir) -> HFBackend:
    backend = make_engine(EngineSpec(str(tiny_model_dir), "cpu", 1))
    backend.load()
    return backend


def test_every_registered_engine_implements_the_whole_protocol():
    assert {"hf", "vllm"} <= set(engine_names())
    for name in engine_names():
        cls = engine_class(name)
        assert issubclass(cls, GenerationBackend) and not cls.__abstractmethods__


def test_hf_backend_is_the_decode_loop_unchanged(hf, prompts):
    table, stats = hf.generate(prompts, 3, PARAMS, worker="w")
    direct, direct_stats = generate_rollouts(hf.model, hf.tokenizer, prompts, 3, PARAMS,
                                             policy_version=0, worker="w")
    check_columns(table, ROLLOUTS, "hf backend")
    drop = ["gen_start", "gen_end"]
    assert table.drop_columns(drop).equals(direct.drop_columns(drop))
    assert stats.decode_tokens == direct_stats.decode_tokens > 0
    assert hf.load_seconds > 0


def test_hf_set_weights_loads_the_version_in_place(hf, prompts, tmp_path):
    before = hf.generate(prompts, 2, PARAMS)[0].column("response_ids").to_pylist()
    changed = HFBackend(hf.model_path, "cpu")
    changed.load()
    with torch.no_grad():
        for p in changed.model.parameters():
            p.mul_(1.5)
    ref = publish_weights(changed.model, tmp_path, version=4)
    hf.set_weights(ref)
    assert hf.version == 4
    after, _ = hf.generate(prompts, 2, PARAMS)
    assert set(after.column("policy_version").to_pylist()) == {4}
    assert after.column("response_ids").to_pylist() != before
    torch.testing.assert_close(hf.model.lm_head.weight, changed.model.lm_head.weight)


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="backend 'tgi': choose one of hf, vllm"):
        make_engine(EngineSpec("m", backend="tgi"))
    with pytest.raises(ValueError, match="cannot import no_such_module:Engine"):
        engine_class("no_such_module:Engine")
    with pytest.raises(ValueError, match="is not a GenerationBackend"):
        engine_class("rlhfless.ops.engine.registry:EngineSpec")


def test_vllm_backend_says_how_to_install_when_vllm_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # "import vllm" raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'rlhfless\[vllm\]'"):
        make_engine(EngineSpec("m", backend="vllm")).load()


# ---- a stand-in for vllm.LLM ------------------------------------------------------------

@dataclass
class FakeLogprob:
    logprob: float


@dataclass
class FakeCompletion:
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, FakeLogprob]]
    finish_reason: str


@dataclass
class FakeOutput:
    outputs: list[FakeCompletion]
    num_cached_tokens: int = 0


class FakeLLM:
    """Records every call; answers ``generate`` with sample i of prompt p = [p0 + i, 7]. A
    stand-in only for what needs CUDA (vLLM's sleep mode, ``colocate``); the real CPU engine
    runs everywhere else (test_vllm_backend.py)."""

    def __init__(self, model: str, **kwargs) -> None:
        self.model, self.kwargs, self.calls = model, kwargs, []
        self.tok = types.SimpleNamespace(batch_decode=lambda ids, **_: [str(x) for x in ids])

    def get_tokenizer(self):
        return self.tok

    def generate(self, prompts, requests, use_tqdm=True, lora_request=None):
        self.calls.append(("generate", len(prompts), requests))
        outs = []
        for j, (prompt, sp) in enumerate(zip(prompts, requests, strict=True)):
            first = prompt["prompt_token_ids"][0]
            comps = [FakeCompletion(i, [first + i, 7], [{first + i: FakeLogprob(-0.5)},
                                                       {7: FakeLogprob(-0.25)}],
                                    "stop" if i % 2 else "length")
                     for i in reversed(range(sp.n))]  # out of order: the backend sorts
            outs.append(FakeOutput(comps, num_cached_tokens=2 if j else 0))
        return outs

    def collective_rpc(self, method, args=()):
        self.calls.append(("rpc", method, args))
        return [3]

    def reset_prefix_cache(self):
        self.calls.append(("reset",))
        return True

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake", tags))


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.SimpleNamespace(LLM=FakeLLM, SamplingParams=lambda **kw:
                                   types.SimpleNamespace(**kw))
    monkeypatch.setitem(sys.modules, "vllm", module)
    return module


def _ids_table(ids: list[list[int]]) -> pa.Table:
    return pa.table({"prompt_id": [f"q{i}" for i in range(len(ids))],
                     "prompt_ids": pa.array(ids, pa.list_(pa.int32())),
                     "answer": pa.array([None] * len(ids), pa.string()),
                     "data_source": ["tally"] * len(ids)})


def test_vllm_weight_update_resets_the_prefix_cache_and_wakes_in_order(fake_vllm, tmp_path,
                                                                       monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # colocate is CUDA's
    weights = tmp_path / "v5.safetensors"
    save_file({"w": torch.zeros(1)}, str(weights))
    backend = VLLMBackend("/models/m", colocate=True)
    backend.load()
    backend.generate(_ids_table([[1, 2]]), 1, PARAMS)
    backend.sleep()
    backend.set_weights(WeightsRef(5, str(weights)))
    kinds = [c[:2] if c[0] != "generate" else ("generate",) for c in backend.llm.calls]
    assert kinds == [("generate",), ("sleep", 1), ("wake", ["weights"]),
                     ("rpc", "rlhfless_load_weights"), ("wake", ["kv_cache"]), ("reset",)]
    assert backend.llm.calls[3][2] == (str(weights),) and backend.version == 5
    not_colocated = VLLMBackend("/models/m")
    not_colocated.load()
    not_colocated.sleep()
    assert not_colocated.llm.calls == []


def test_hf_backend_loads_the_dtype_asked_for(tiny_model_dir):
    engine = make_engine(EngineSpec(str(tiny_model_dir), "cpu", dtype="float64"))
    engine.load()
    assert engine.model.dtype == torch.float64
    with pytest.raises(ValueError, match="dtype 'int8': choose one of auto, float32"):
        make_engine(EngineSpec(str(tiny_model_dir), "cpu", dtype="int8")).load()


def test_the_engine_reports_its_kv_bytes_per_token_at_its_dtype(tiny_model_dir):
    """Keys and values of every layer, per context token, at the weights' element size: the
    prior of a KV move's cost (before, fp32 whatever the engine's dtype)."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    per_number = 2 * config["num_hidden_layers"] * kv_heads * head_dim
    for dtype, size in (("float32", 4), ("bfloat16", 2), ("float64", 8)):
        spec = EngineSpec(str(tiny_model_dir), "cpu", dtype=dtype)
        assert HFBackend.kv_bytes_per_token(spec) == per_number * size
    assert VLLMBackend.kv_bytes_per_token(EngineSpec("m", backend="vllm")) is None  # no export
