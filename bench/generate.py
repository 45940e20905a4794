"""Generation throughput: ours with and without prefix sharing vs ``model.generate()``.

Same model (the embedded tiny default), same prompts (held-out tally prompts, which share
an instruction template), same settings (sampling at temperature 1, top-p 1, no top-k,
``n`` samples per prompt, ``max_new_tokens``). Tokens/s counts generated tokens up to and
including EOS. Each variant runs ``--repeats`` times interleaved; the median is reported.
Prints one JSON line.

    python bench/generate.py [--prompts 64] [--samples 8] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhfless.ops.data.load import read_prompts
from rlhfless.ops.data.prefix_dedup import plan_prefixes
from rlhfless.ops.engine.engine_types import SamplingParams
from rlhfless.ops.engine.generate import decode
from rlhfless.ops.toy.tinymodel import ensure_tiny_model


def ours(model, tok, ids, plan_lens, n, params) -> int:
    results = decode(model, ids, n, params, tok.eos_token_id, tok.pad_token_id, plan_lens)
    return sum(len(r[0]) for r in results)


def hf_generate(model, tok, ids, n, params) -> int:
    width = max(len(p) for p in ids)
    input_ids = torch.full((len(ids), width), tok.pad_token_id)
    mask = torch.zeros_like(input_ids)
    for i, p in enumerate(ids):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True,
                         num_return_sequences=n, max_new_tokens=params.max_new_tokens,
                         temperature=params.temperature, top_p=params.top_p, top_k=0,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    generated = out[:, width:]
    total = 0
    for row in generated.tolist():
        total += row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = ensure_tiny_model(log=lambda *_: None)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    prompts = read_prompts(path / "heldout.jsonl", tok).table.slice(0, args.prompts)
    ids = prompts.column("prompt_ids").to_pylist()
    plan = plan_prefixes(prompts, args.samples)
    plan_lens = plan.prompts.column("prefix_len").to_pylist()
    params = SamplingParams(args.max_new_tokens, temperature=1.0, top_p=1.0)
    variants = {
        "ours_dedup": lambda: ours(model, tok, ids, plan_lens, args.samples, params),
        "ours_no_dedup": lambda: ours(model, tok, ids, None, args.samples, params),
        "hf_generate": lambda: hf_generate(model, tok, ids, args.samples, params),
    }
    rates: dict[str, list[float]] = {name: [] for name in variants}
    with torch.inference_mode():
        variants["ours_dedup"]()  # warm-up
        for _ in range(args.repeats):
            for name, run in variants.items():
                started = time.perf_counter()
                tokens = run()
                rates[name].append(tokens / (time.perf_counter() - started))
    median = {name: statistics.median(r) for name, r in rates.items()}
    print(json.dumps({
        "bench": "generate", "prompts": len(ids), "samples": args.samples,
        "max_new_tokens": args.max_new_tokens, "threads": args.threads,
        "tokens_per_s": {k: round(v, 1) for k, v in median.items()},
        "speedup_vs_generate": round(median["ours_dedup"] / median["hf_generate"], 3),
        "speedup_no_dedup_vs_generate": round(median["ours_no_dedup"] / median["hf_generate"], 3),
        "prefill_tokens_naive": plan.naive_prefill_tokens,
        "prefill_tokens_planned": plan.planned_prefill_tokens,
    }))


if __name__ == "__main__":
    main()
