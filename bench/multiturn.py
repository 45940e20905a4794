"""Multi-turn generation: KV cache kept across turns vs the conversation re-prefilled every
turn, greedy, in float64, on the embedded multi-turn task (tally-tool: its warm-started model,
its held-out prompts, its lookup environment).

Both runs play the same episodes (``ops/rollouts/episode.run_episodes``, ``keep_kv`` True / False);
the bench checks that their token ids are identical and reports seconds and prefill tokens
of each (median of ``--repeats``, interleaved). Prints one JSON line.

    python bench/multiturn.py [--prompts 32] [--repeats 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhfless.ops.data.load import read_prompts
from rlhfless.ops.engine.backend import HFBackend
from rlhfless.ops.engine.engine_types import SamplingParams
from rlhfless.ops.engine.gen_stats import GenerationStats
from rlhfless.ops.rollouts.episode import EpisodeParams, run_episodes
from rlhfless.ops.toy.tinymodel import TASK_RECIPES, ensure_tiny_model


def play(model, tok, prompts, keep_kv: bool, max_turns: int):
    stats = GenerationStats()
    params = EpisodeParams("tally-tool", max_turns=max_turns, max_turn_tokens=64,
                           max_episode_tokens=192, keep_kv=keep_kv)
    started = time.perf_counter()
    table, episodes = run_episodes(HFBackend.of_model(model, tok), prompts, 1,
                                   SamplingParams(64, greedy=True), params, stats=stats)
    return time.perf_counter() - started, table, stats, episodes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-turns", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = ensure_tiny_model(recipe=TASK_RECIPES["tally-tool"])
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    prompts = read_prompts(path / "heldout.jsonl", tok).table.slice(0, args.prompts)
    seconds: dict[bool, list[float]] = {True: [], False: []}
    out = {}
    for _ in range(args.repeats):
        for keep in (True, False):
            s, table, stats, episodes = play(model, tok, prompts, keep, args.max_turns)
            seconds[keep].append(s)
            out[keep] = (table.column("response_ids").to_pylist(), stats, episodes)
    kept, again = out[True], out[False]
    kept_s, again_s = statistics.median(seconds[True]), statistics.median(seconds[False])
    print(json.dumps({
        "episodes": len(prompts), "turns": kept[2].turns,
        "identical_tokens": kept[0] == again[0],
        "kv_kept_s": round(kept_s, 3), "reprefill_s": round(again_s, 3),
        "speedup": round(again_s / kept_s, 3),
        "kv_kept_prefill_tokens": kept[1].prefill_tokens,
        "reprefill_prefill_tokens": again[1].prefill_tokens,
        "generated_tokens": kept[1].decode_tokens, "repeats": args.repeats,
        "threads": args.threads,
    }))


if __name__ == "__main__":
    main()
