"""Bench-size variants of the embedded model: wider and deeper, same answers.

The embedded tiny Llama (``tinymodel.py``) is so small that a decode step is all overhead
and intra-op threads cannot pay. Training a larger model on this machine takes hours, so a
bench-size variant is the trained tiny model *widened* function-preservingly (Net2Net
style): every new unit reads the residual stream with random weights but writes to it with
zero weights, and the hidden state's new dimensions stay exactly zero. The variant costs
what a dense model of its size costs (CPU matmuls do not skip zeros) and decodes the same
responses (up to float rounding: longer dot products sum in another order), so the task's
long tail of response lengths is kept.

How each piece is kept equal, for a hidden size ``h`` widened to ``H``:

- embeddings (tied with the output head) get zero columns: the logits are unchanged;
- RMSNorm divides by the root mean square over ``H`` dims, of which ``h`` are non-zero:
  the old weights are scaled by ``sqrt(h / H)`` and ``eps`` by ``h / H``, which gives
  exactly the old normalisation;
- attention keeps ``head_dim`` and the query-to-KV-head grouping; new heads' output
  projection columns are zero; MLP units likewise (zero ``down_proj`` columns);
- new layers (``num_layers`` beyond the tiny one's) have zero output projections, so they
  add nothing to the residual stream while costing a full layer, KV cache included.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from .tinymodel import cached_build, default_cache_dir, ensure_tiny_model

NEW_WEIGHT_STD = 0.02  # reads of the new units: random, so no kernel meets an all-zero input


@dataclass(frozen=True)
class BenchSize:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    seed: int = 0

    def key(self) -> str:
        return "-".join(str(v) for v in asdict(self).values())


BENCH_SIZES = {  # bench name -> size; "tiny" is the embedded model itself
    "small": BenchSize(256, 768, 4),
    "bench": BenchSize(1024, 3072, 8),
    "wide": BenchSize(2048, 6144, 4),  # a second thread speeds a step up to ~1.3x here
    "wide64": BenchSize(2048, 6144, 4),  # the same weights, generated in float64
}
# bench name -> its generation engine's dtype (``EngineSpec.dtype``) where not the default.
# On this 2-core CPU a second torch thread speeds a float64 decode step of ``wide`` at
# batches 2-16 by 1.3-1.8x (float32: 1.0-1.3x): there one worker with both threads decodes
# two tails sooner than two one-thread workers decode one each (bench/tail.py).
BENCH_DTYPES = {"wide64": "float64"}


def bench_dtype(name: str) -> str:
    """The generation engine dtype the bench model ``name`` runs in."""
    return BENCH_DTYPES.get(name, "auto")


def widen(model: LlamaForCausalLM, size: BenchSize) -> LlamaForCausalLM:
    """A wider, deeper copy of ``model`` that computes the same function; see the module
    docstring."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    h, big = cfg.hidden_size, size.hidden_size
    if big % (head_dim * group) or big < h or size.intermediate_size < cfg.intermediate_size \
            or size.num_layers < cfg.num_hidden_layers:
        raise ValueError(f"widen: {size} cannot hold the model (hidden {h}, head_dim "
                         f"{head_dim}, group {group}, {cfg.num_hidden_layers} layers)")
    heads = big // head_dim
    wide_cfg = LlamaConfig(**{**cfg.to_dict(), "hidden_size": big,
                              "intermediate_size": size.intermediate_size,
                              "num_hidden_layers": size.num_layers,
                              "num_attention_heads": heads, "num_key_value_heads": heads // group,
                              "head_dim": head_dim, "rms_norm_eps": cfg.rms_norm_eps * h / big})
    wide = LlamaForCausalLM(wide_cfg).to(model.dtype)
    gen = torch.Generator().manual_seed(size.seed)
    scale = (h / big) ** 0.5
    old = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in wide.named_parameters():
            src = old.get(name)
            if name.endswith("norm.weight"):  # new dims: zero; old ones rescaled
                param.zero_()
                param[:h] = (src if src is not None else 1.0) * scale
                continue
            if name.endswith(("o_proj.weight", "down_proj.weight", "embed_tokens.weight")):
                param.zero_()  # writes to the residual stream (and the tied head)
            else:
                param.normal_(0.0, NEW_WEIGHT_STD, generator=gen)
            if src is not None:
                param[tuple(slice(0, n) for n in src.shape)] = src
    return wide.eval()


def ensure_bench_model(name: str, cache_dir: str | Path | None = None, log=print) -> Path:
    """Directory of the bench model ``name`` ("tiny" or a key of ``BENCH_SIZES``), made
    from the embedded model on first use and cached."""
    tiny = ensure_tiny_model(cache_dir, log=log)
    if name == "tiny":
        return tiny
    if name not in BENCH_SIZES:
        raise ValueError(f"bench model {name!r}; allowed: tiny, {', '.join(BENCH_SIZES)}")
    size = BENCH_SIZES[name]
    root = Path(cache_dir) if cache_dir else default_cache_dir()

    def build(tmp: Path) -> dict:
        wide = widen(LlamaForCausalLM.from_pretrained(tiny), size)
        wide.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(tiny).save_pretrained(tmp)
        params = sum(p.numel() for p in wide.parameters())
        log(f"bench model {name}: {params / 1e6:.1f}M params")
        return {"size": asdict(size), "params": params}

    return cached_build(root / f"{tiny.name}-wide-{size.key()}", build)
