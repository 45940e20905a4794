"""Our decode loop (engine ``hf``) vs vLLM (engine ``vllm``) behind the one engine protocol.

Per model size (``--models``): ``tiny``, the embedded model (built into the default cache
if it is not there), and ``bench``, a ~100M-parameter Llama with random weights made in
``--workdir`` (hidden 768, 12 layers of 12 heads, MLP 2048, 512 positions, the tiny model's
tokenizer and vocabulary). Both engines are loaded in this process, vLLM first (on CPU its
``gpu_memory_utilization`` is a share of the NUMA node's RAM, this process's own memory
included; the bench model's share is larger, so that its KV cache holds the whole batch as
the hf engine's does: 256 x ~90 tokens x 74 kB), each with ``--threads`` torch threads,
float32:

1. cold start: ``engine.load_seconds`` (the model files are in the page cache: just
   written, or read by the other engine);
2. generation tokens/s: ``engine.generate`` of ``--prompts`` training prompts x
   ``--samples`` samples (the main job's batch), sampling at temperature 1, seeded by the
   repeat; generated tokens (up to and including EOS) over the call's wall seconds, median
   of ``--repeats``, the two engines interleaved (alternating which goes first) after one
   untimed warm-up call each (the batch, 8 tokens). The random ``bench`` model seldom
   samples EOS: its responses run to ``--max-new-tokens``;
3. weight update: a changed version (every weight x 1.001) published with
   ``publish_weights``, then ``engine.set_weights(ref)`` timed, median of ``--repeats``.

The vLLM engine is closed before the next model loads. Then, with ``--elastic-iterations``
> 0, one short training run per (engine, policy) on the long-tail task (``task =
"tally-long"``, the tiny model, ``--gen-workers`` generation workers of 1 thread):
worker-seconds of the whole run (cold starts and evaluations included) from its cost
ledger; per iteration from its metrics, the worker-seconds billed to the iteration, its
seconds and its generation seconds (elastic: from the start of generation to the last
landed row, ``generation_s``; static: the generate stage's span in Dask's task stream,
``generate_wall_s``). Prints one JSON line.

    python bench/engines.py [--models tiny,bench] [--repeats 3] [--elastic-iterations 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from rlhfless.ops.data.load import read_prompts
from rlhfless.ops.engine.engine_types import EngineSpec, SamplingParams
from rlhfless.ops.engine.publish import publish_weights
from rlhfless.ops.engine.registry import make_engine
from rlhfless.ops.toy.tinymodel import ensure_tiny_model
from rlhfless.pipeline.config import Config
from rlhfless.pipeline.train.loop import train

ENGINES = ("hf", "vllm")
BENCH_LLAMA = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
               "num_key_value_heads": 12, "intermediate_size": 2048,
               "max_position_embeddings": 512}


def build_bench_model(dest: Path, tiny: Path, seed: int = 0) -> Path:
    """A Llama of ``BENCH_LLAMA``'s shape with random weights, saved in Hugging Face format
    with the tiny model's tokenizer (whose vocabulary it takes)."""
    tok = AutoTokenizer.from_pretrained(tiny)
    config = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         tie_word_embeddings=True, **BENCH_LLAMA)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


def generated_tokens(engine, prompts, n: int, params: SamplingParams) -> tuple[int, float]:
    """(response tokens, wall seconds) of one ``engine.generate`` call."""
    started = time.perf_counter()
    table, _ = engine.generate(prompts, n, params)
    seconds = time.perf_counter() - started
    return sum(len(r) for r in table.column("response_ids").to_pylist()), seconds


def bench_model(path: Path, prompts, store: Path, memory: float, args) -> dict:
    """Cold start, generation tokens/s and weight-update seconds of both engines on the
    model at ``path`` (``prompts``: a PROMPTS table of its tokenizer); published versions go
    to ``store``; ``memory``: the vLLM engine's ``gpu_memory_utilization``."""
    engines = {}
    for name in ("vllm", "hf"):  # vLLM first: see the module docstring
        engines[name] = make_engine(EngineSpec(str(path), "cpu", args.threads, name,
                                               dtype="float32",
                                               gpu_memory_utilization=memory))
        engines[name].load()
    try:
        params = [SamplingParams(args.max_new_tokens, temperature=1.0, top_p=1.0, seed=r)
                  for r in range(args.repeats)]
        with torch.inference_mode():
            for engine in engines.values():  # warm-up, untimed: the batch, 8 tokens
                engine.generate(prompts, args.samples, SamplingParams(8))
            runs: dict[str, list[tuple[int, float]]] = {name: [] for name in ENGINES}
            for r in range(args.repeats):
                for name in ENGINES if r % 2 == 0 else ENGINES[::-1]:
                    runs[name].append(generated_tokens(engines[name], prompts, args.samples,
                                                       params[r]))
        trainer = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        updates: dict[str, list[float]] = {name: [] for name in ENGINES}
        publish_s = []
        for version in range(1, args.repeats + 1):
            with torch.no_grad():
                for p in trainer.parameters():
                    p.mul_(1.001)
            started = time.perf_counter()
            ref = publish_weights(trainer, store, version)
            publish_s.append(time.perf_counter() - started)
            for name in ENGINES if version % 2 else ENGINES[::-1]:
                started = time.perf_counter()
                engines[name].set_weights(ref)
                updates[name].append(time.perf_counter() - started)
        out = {"params": sum(p.numel() for p in engines["hf"].model.parameters()),
               "prompt_tokens_mean": round(sum(len(p) for p in prompts.column(
                   "prompt_ids").to_pylist()) / len(prompts), 1),
               "publish_s": round(statistics.median(publish_s), 3)}
        cache = engines["vllm"].llm.llm_engine.vllm_config.cache_config
        out["vllm_gpu_memory_utilization"] = memory
        out["vllm_kv_cache_tokens"] = cache.num_gpu_blocks * cache.block_size
        for name in ENGINES:
            rates = [tokens / seconds for tokens, seconds in runs[name]]
            out[name] = {
                "load_s": round(engines[name].load_seconds, 2),
                "tokens_per_s": round(statistics.median(rates), 1),
                "tokens_per_s_runs": [round(x, 1) for x in rates],
                "tokens_per_call": [tokens for tokens, _ in runs[name]],
                "set_weights_s": round(statistics.median(updates[name]), 3),
                "set_weights_s_runs": [round(x, 3) for x in updates[name]],
            }
        out["vllm_over_hf_tokens_per_s"] = round(
            out["vllm"]["tokens_per_s"] / out["hf"]["tokens_per_s"], 3)
        return out
    finally:
        engines["vllm"].close()


def run_policy(engine: str, policy: str, args, runs_dir: Path) -> dict:
    """One short training run on the long-tail task: worker-seconds and per-iteration
    generation and iteration seconds."""
    cfg = Config(name=f"{engine}-{policy}", runs_dir=str(runs_dir), task="tally-long",
                 backend=engine, gen_dtype="float32", policy=policy,
                 iterations=args.elastic_iterations, eval_every=args.elastic_iterations,
                 heldout_prompts=8, batch_prompts=args.prompts, n_samples=args.samples,
                 max_new_tokens=args.max_new_tokens, gen_workers=args.gen_workers,
                 gen_threads=1, gpu_memory_utilization=args.gpu_memory_utilization,
                 seed=args.seed)
    started = time.perf_counter()
    run = train(cfg, progress=False, log=lambda *_: None)
    wall = time.perf_counter() - started
    ledger = run.read_json("ledger.json")["totals"]
    iters = [m for m in run.metrics() if m.get("event") == "iteration"]
    run.release()
    return {
        "wall_s": round(wall, 2),
        "worker_s": round(ledger["worker_s"], 2),
        "gen_worker_s": round(ledger["gen_worker_s"], 2),
        "generation_s": [round(m.get("generation_s", m.get("generate_wall_s", 0.0)), 2)
                         for m in iters],
        "iteration_s": [round(m["iteration_s"], 2) for m in iters],
        "iteration_worker_s": [round(m.get("gen_worker_s", 0.0) + m.get("train_worker_s", 0.0), 2)
                               for m in iters],
        "gen_workers": [m.get("gen_workers", args.gen_workers) for m in iters],
        "migrated_sequences": sum(m.get("migrated_sequences", 0) for m in iters),
        "response_len_max": [m.get("response_len_max") for m in iters],
    }


def bench_elastic(args, runs_dir: Path) -> dict:
    out: dict = {"task": "tally-long", "iterations": args.elastic_iterations,
                 "gen_workers_max": args.gen_workers, "gen_threads": 1}
    for engine in ENGINES:
        both = {policy: run_policy(engine, policy, args, runs_dir)
                for policy in ("static", "elastic")}
        static, elastic = both["static"], both["elastic"]
        out[engine] = {**both,
                       "worker_s_ratio": round(elastic["worker_s"] / static["worker_s"], 3),
                       "generation_s_ratio_last": round(
                           elastic["generation_s"][-1] / static["generation_s"][-1], 3)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="tiny,bench", help="comma-separated: tiny, bench")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.15,
                        help="vLLM's share of the NUMA node's RAM: tiny and the training runs")
    parser.add_argument("--bench-gpu-memory-utilization", type=float, default=0.4,
                        help="the bench model's: its KV cache holds the whole batch")
    parser.add_argument("--elastic-iterations", type=int, default=2, help="0: skip that part")
    parser.add_argument("--gen-workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default="", help="models and runs; empty: a temp dir")
    args = parser.parse_args()
    load_start = os.getloadavg()
    started = time.perf_counter()
    tiny = ensure_tiny_model(log=lambda *_: None)  # the default cache, outside the timings
    prompts = read_prompts(tiny / "train.jsonl", AutoTokenizer.from_pretrained(tiny)).table
    prompts = prompts.slice(0, args.prompts)  # the bench model has the same tokenizer
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-engines-"))
    try:
        models = {}
        for name in args.models.split(","):
            if name == "tiny":
                path, memory = tiny, args.gpu_memory_utilization
            elif name == "bench":
                path = build_bench_model(workdir / "bench-model", tiny, args.seed)
                memory = args.bench_gpu_memory_utilization
            else:
                raise SystemExit(f"--models: unknown model {name!r}; choose tiny or bench")
            models[name] = bench_model(path, prompts, workdir / f"store-{name}", memory, args)
        elastic = (bench_elastic(args, workdir / "runs") if args.elastic_iterations > 0
                   else {"skipped": "--elastic-iterations 0"})
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps({
        "bench": "engines", "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
        "wall_s": round(time.perf_counter() - started, 1), "models": models,
        "elastic": elastic,
        "args": {k: v for k, v in vars(args).items() if k != "workdir"}
        | {"dtype": "float32", "device": "cpu", "threads_per_engine": args.threads},
    }))


if __name__ == "__main__":
    main()
