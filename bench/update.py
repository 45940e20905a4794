"""The update's forward and backward pass: shared prompts and length chunks vs one padded
sequence per row.

Same model (the embedded tiny default, float32, ``--threads`` torch threads), same batch
(``--prompts`` train prompts × ``--samples`` sampled responses, at most 64 new tokens), same
loss (the sum of the response tokens' log-probabilities). ``ours`` is
``ops.engine.forward.response_logprobs`` (each distinct prompt once, responses in chunks of
similar length); ``per_row`` is the usual layout of RL trainers without padding removal:
prompt + response of every row, right-padded, rows sorted by length, in micro-batches of at
most ``--micro-batch-tokens`` padded tokens. Each runs ``--repeats`` times, interleaved; the
median seconds and the tokens that went through the model are printed as one JSON line.

    python bench/update.py [--prompts 32] [--samples 8] [--threads 1] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhfless.ops.algo.update import pack_micro_batches
from rlhfless.ops.data.load import read_prompts
from rlhfless.ops.engine.engine_types import SamplingParams
from rlhfless.ops.engine.forward import response_logprobs, right_pad
from rlhfless.ops.engine.generate import decode
from rlhfless.ops.toy.tinymodel import ensure_tiny_model


def per_row_pass(model, prompts, responses, pad_id: int, budget: int) -> int:
    """Forward + backward with one right-padded sequence per row; returns padded tokens."""
    rows = [p + r for p, r in zip(prompts, responses)]
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    padded = 0
    start = 0
    while start < len(order):  # consecutive rows while rows × longest fits the budget
        end = start + 1
        while end < len(order) and (end - start + 1) * len(rows[order[end]]) <= budget:
            end += 1
        batch = [order[j] for j in range(start, end)]
        ids, mask = right_pad([rows[i] for i in batch], pad_id)
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1], -1)
        logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        scored = torch.zeros_like(mask, dtype=torch.bool)
        for k, i in enumerate(batch):
            scored[k, len(prompts[i]) : len(rows[i])] = True
        logp[scored[:, 1:]].sum().backward()
        padded += ids.numel()
        start = end
    return padded


def shared_pass(model, prompts, responses, pad_id: int, budget: int) -> int:
    """Forward + backward through ``response_logprobs`` in the update's micro-batches;
    returns the real tokens that went through the model."""
    tokens = 0
    for batch in pack_micro_batches(prompts, [len(r) for r in responses], budget):
        logp, mask = response_logprobs(model, [prompts[i] for i in batch],
                                       [responses[i] for i in batch], pad_id, 1.0)
        logp[mask].sum().backward()
        tokens += sum(len(p) for p in {tuple(prompts[i]) for i in batch}) + int(mask.sum())
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = ensure_tiny_model(log=lambda *_: None)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = read_prompts(path / "train.jsonl", tok).table.slice(0, args.prompts)
    ids = ids.column("prompt_ids").to_pylist()
    results = decode(model, ids, args.samples, SamplingParams(max_new_tokens=64, seed=0),
                     tok.eos_token_id, tok.pad_token_id)
    prompts = [p for p in ids for _ in range(args.samples)]
    responses = [r[0] for r in results]
    kept = [i for i, r in enumerate(responses) if r]
    prompts, responses = [prompts[i] for i in kept], [responses[i] for i in kept]
    model.train()
    variants = {"ours": shared_pass, "per_row": per_row_pass}
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    tokens: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, run in variants.items():
            model.zero_grad(set_to_none=True)
            started = time.perf_counter()
            tokens[name] = run(model, prompts, responses, tok.pad_token_id,
                               args.micro_batch_tokens)
            seconds[name].append(time.perf_counter() - started)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    print(json.dumps({
        "bench": "update", "prompts": args.prompts, "samples": args.samples,
        "threads": args.threads, "repeats": args.repeats,
        "response_tokens": sum(map(len, responses)),
        "prompt_tokens_per_row": sum(map(len, prompts)),
        "forward_backward_s": {name: round(s, 3) for name, s in median.items()},
        "real_tokens_through_model": {
            "ours": tokens["ours"],
            "per_row": sum(map(len, prompts)) + sum(map(len, responses))},
        "padded_tokens_per_row": tokens["per_row"],
        "speedup_vs_per_row": round(median["per_row"] / median["ours"], 2),
    }))


if __name__ == "__main__":
    main()
