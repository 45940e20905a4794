"""Agent episodes through the endpoint against the same requests in-process, one invocation.

Plays ``--prompts`` agent episodes of two chat requests each (``two_requests`` below, written
with the ``openai`` client) on our engine over the embedded tiny model, through the
worker's endpoint (``ops/rollouts/agent.py``), then replays the very requests the endpoint
recorded as two ``decode_turns`` batches of the same engine, in-process (the second
continuing from the KV the engine kept of the first, as the endpoint's does). Prints per episode
the model seconds (its requests' time at the endpoint) and the agent seconds (the rest of
its wall time), and the endpoint's overhead: (episodes' wall − in-process seconds) / wall,
with and without the agent process's start. The first shard of a worker starts its agent
process cold and its endpoint's first engine call warms the engine on a new thread: it is
reported apart (``cold``); each later shard's process was started when the shard before
ended, and ``--gap-s`` (the trainer's update in a run) passes between shards. Each count of
``--processes`` (agent processes per shard: ``AgentParams.processes``) is measured in turn,
shard by shard, so that a drift in the machine's load weighs on each alike. Prints one JSON
line.

    python bench/agents.py [--prompts 16] [--max-tokens 16] [--repeats 3] [--gap-s 2]
                           [--processes 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from statistics import median

# the agent process imports this module for ``two_requests``: everything heavy is imported
# in the functions that run here, so its start is the agent's own


def two_requests(client, row, model):
    """Ask, send the answer back with a user message, ask again."""
    messages = [{"role": "user", "content": row["prompt_text"]}]
    first = client.chat.completions.create(model=model, messages=messages,
                                           max_tokens=int(row.get("max_tokens", 16)))
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "Items: fig pear\nAnswer:"}]
    client.chat.completions.create(model=model, messages=messages,
                                   max_tokens=int(row.get("max_tokens", 16)))
    return 1.0


def replay_seconds(engine, played, sampling) -> float:
    """Seconds to sample the recorded requests in-process: every episode's k-th request in
    one batch, as the endpoint batched them, continuing from what the engine kept of the
    episode's request before, as the endpoint does."""
    from rlhfless.ops.engine.engine_types import Turn
    from rlhfless.ops.engine.gen_stats import GenerationStats

    kept: dict[int, object] = {}
    started = time.perf_counter()
    for k in range(max(len(calls) for _, calls in played)):
        turns = [Turn(list(calls[k].prompt_ids), len(calls[k].samples[0][0]) or 1, i,
                      kept.get(i)) for i, (_, calls) in enumerate(played) if len(calls) > k]
        engine.decode_turns(turns, sampling, GenerationStats(), keep_cache=True)
        kept = {t.key: t.cache for t in turns}
    return time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gap-s", type=float, default=2.0)
    ap.add_argument("--processes", default="1,2", help="agent processes per shard, compared")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from rlhfless.ops.data.load import read_prompts
    from rlhfless.ops.engine.engine_types import EngineSpec, SamplingParams
    from rlhfless.ops.engine.registry import make_engine
    from rlhfless.ops.engine.rows import expand_samples
    from rlhfless.ops.rollouts import agent_process
    from rlhfless.ops.rollouts.agent import AgentParams
    from rlhfless.ops.toy.tinymodel import ensure_tiny_model

    load = os.getloadavg()
    model_dir = ensure_tiny_model(log=lambda *_: None)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = read_prompts(model_dir / "train.jsonl", tok).table.slice(0, args.prompts)
    rows = expand_samples(prompts, 1)
    rows = rows.append_column("max_tokens", [[args.max_tokens] * len(rows)])
    engine = make_engine(EngineSpec(str(model_dir), "cpu", args.threads))
    engine.load()
    # greedy: the replay samples what the endpoint sampled, token for token
    sampling = SamplingParams(max_new_tokens=args.max_tokens, greedy=True)
    counts = [int(k) for k in args.processes.split(",")]
    runs: dict[int, list[dict]] = {k: [] for k in counts}
    for repeat in range(1 + args.repeats):  # the settings alternate, each shard after a gap
        for k in counts:
            params = AgentParams("agents:two_requests", timeout_s=120,
                                 concurrency=args.prompts, processes=k)
            while len(agent_process.SPARES) < k:  # the last shard started the other count
                agent_process.SPARES.append(agent_process.AgentProcess.start(params.agent))
            time.sleep(args.gap_s if repeat or k != counts[0] else 0.0)
            runs[k].append(one_shard(engine, rows, sampling, params))
    engine.close()
    settings = {}
    for k, results in runs.items():
        cold, results = results[0], results[1:]
        settings[str(k)] = {
            "cold": cold, "repeats": results,
            "overhead_median": median(r["overhead"] for r in results),
            "overhead_without_process_start_median": median(
                r["overhead_without_process_start"] for r in results)}
    print(json.dumps({
        "bench": "agents", "load_avg_start": load, "load_avg_end": os.getloadavg(),
        "prompts": args.prompts, "requests_per_episode": 2, "max_tokens": args.max_tokens,
        "threads": args.threads, "gap_s": args.gap_s, "processes": settings}))


def one_shard(engine, rows, sampling, params) -> dict:
    """One shard's episodes through the endpoint, then the same requests in-process."""
    from rlhfless.ops.engine.gen_stats import GenerationStats
    from rlhfless.ops.rollouts.agent import play_agents

    started = time.perf_counter()
    played = play_agents(engine, rows, sampling, params, GenerationStats())
    wall = time.perf_counter() - started
    assert all("error" not in o for o, _ in played), played[0][0]
    episode_wall = max(o["seconds"] for o, _ in played)
    direct = replay_seconds(engine, played, sampling)
    model_s = [sum(c.seconds for c in calls) for _, calls in played]
    agent_s = [o["seconds"] - m for (o, _), m in zip(played, model_s)]
    return {"wall_s": wall, "episodes_wall_s": episode_wall, "in_process_s": direct,
            "model_s_median": median(model_s), "agent_s_median": median(agent_s),
            "overhead": (wall - direct) / wall,
            "overhead_without_process_start": (episode_wall - direct) / episode_wall}


if __name__ == "__main__":
    main()
