"""How long one cost-aware scaling decision takes (issue: under 30 ms, goal under 5 ms).

Times ``choose_generation_workers`` for 1,024 prompts x 8 samples with log-normal predicted
response lengths (p50 ~ 500 tokens, p99 ~ 5,000) and up to 160 generation workers, on the
throughput model's priors, and prints one JSON line: median and p95 milliseconds over the
repeats, and the worker count chosen at lambda 0.2, 0.5 and 0.8 (with its predicted time and
worker-seconds). Run: ``python bench/scaling_decision.py [--repeats 50]``.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from rlhfless.schedulers.scaling import choose_generation_workers
from rlhfless.schedulers.throughput import ThroughputModel

N_PROMPTS = 1024
N_SAMPLES = 8
MAX_WORKERS = 160
PROMPT_TOKENS = 256  # per group; prefilled once per group (shared prefix)


def predicted_lengths(rng: np.random.Generator) -> np.ndarray:
    """Log-normal lengths with median 500 and 99th percentile 5,000 tokens."""
    sigma = np.log(10.0) / 2.3263  # p99 / p50 = 10
    return np.maximum(rng.lognormal(np.log(500.0), sigma, N_PROMPTS), 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    model = ThroughputModel(max_batch=256)  # vLLM's default max_num_seqs
    pred = predicted_lengths(rng)

    def decide(lam: float, lengths: np.ndarray):
        return choose_generation_workers(
            lengths, N_SAMPLES, model, max_workers=MAX_WORKERS, lambda_cost=lam,
            prompt_tokens=PROMPT_TOKENS,
        )

    decide(0.5, pred)  # warm-up: first-call imports and allocations
    times_ms = []
    for _ in range(args.repeats):
        lengths = predicted_lengths(rng)  # a fresh iteration's predictions each time
        t0 = time.perf_counter()
        decide(0.5, lengths)
        times_ms.append((time.perf_counter() - t0) * 1e3)
    chosen = {}
    for lam in (0.2, 0.5, 0.8):
        d = decide(lam, pred)
        chosen[str(lam)] = {
            "n_workers": d.n_workers,
            "time_s": round(d.predicted_seconds, 1),
            "worker_s": round(d.predicted_cost_ws, 1),
        }
    print(json.dumps({
        "bench": "scaling_decision",
        "n_prompts": N_PROMPTS,
        "n_samples": N_SAMPLES,
        "max_workers": MAX_WORKERS,
        "repeats": args.repeats,
        "median_ms": round(float(np.median(times_ms)), 3),
        "p95_ms": round(float(np.percentile(times_ms, 95)), 3),
        "chosen": chosen,
        "model": model.to_record(),
    }))


if __name__ == "__main__":
    main()
