"""A tail moved between workers, in the trace: on a real PoolCluster, a shard's chunk on one
generation worker stops at ``tau`` and its cut rows continue on the other (the elastic
policy's recompute move, ``pipeline/tasks/rollout.py``); the run's trace writer
(``TaskStream`` and ``RunTrace``) shows the chunk on the first worker with its cold start,
prefill, decode and ``pause`` inside it, and the continuation on the second with its own
cold start, the recomputed prefill and decode; the decode spans' tokens of both add up to
the tokens both tasks report."""

from __future__ import annotations

from rlhfless.ops.data.load import read_prompts
from rlhfless.ops.engine.engine_types import EngineSpec, SamplingParams, WeightsRef
from rlhfless.pipeline.cluster.pools import Pool, PoolCluster
from rlhfless.pipeline.report.trace import RunTrace, TaskStream
from rlhfless.pipeline.report.trace_events import read_trace
from rlhfless.pipeline.task_keys import task_key
from rlhfless.pipeline.tasks.rollout import GenSpec, continue_task, drop_task, generate_chunk_task
from rlhfless.schedulers.ledger import CostLedger


def test_a_moved_tail_shows_on_both_workers(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    shard = read_prompts(tiny_model_dir / "train.jsonl",
                         AutoTokenizer.from_pretrained(tiny_model_dir)).table.slice(0, 6)
    spec = GenSpec(EngineSpec(str(tiny_model_dir)), 4,
                   SamplingParams(max_new_tokens=24, temperature=1.0))
    weights = WeightsRef(0, str(tiny_model_dir))
    pools = [Pool("gen", 2, 1, {"GEN": 1}, "2GiB")]
    with PoolCluster(pools, CostLedger({"gen": 1.0})) as pc:
        stream, c = TaskStream(pc.client), pc.client
        first, second = pc.worker_names("gen")[:2]
        chunk_key, move_key = task_key("generate", 1, 0), task_key("continue", 1, 0, 0)
        out = c.submit(generate_chunk_task, shard, weights, spec, 1, 0.25, chunk_key,
                       key=chunk_key, workers=[pc.address_of(first)]).result()
        assert c.submit(drop_task, chunk_key, workers=[pc.address_of(first)],
                        pure=False).result()
        rest = c.submit(continue_task, out["cut"], weights, spec, 7, key=move_key,
                        workers=[pc.address_of(second)]).result()
        trace = RunTrace(tmp_path / "trace.json")
        trace.write(stream.take(), {1: {"generated_by": 0}})
        trace.close()
    events = read_trace(tmp_path / "trace.json")
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    spans = [e for e in events if e["ph"] == "X"]
    tasks = {e["args"]["key"]: e for e in spans if e["cat"] == "task"}
    assert names[tasks[chunk_key]["pid"]] == first and names[tasks[move_key]["pid"]] == second
    inside = {key: [e for e in spans if e["cat"] == "phase" and e["args"]["key"] == key]
              for key in (chunk_key, move_key)}
    assert [e["name"] for e in inside[chunk_key]] == ["cold_start", "prefill", "decode",
                                                      "pause"]
    assert inside[chunk_key][-1]["args"] | {"finished": None} == {
        "key": chunk_key, "iteration": 1, "shard": 0, "tag": "", "live": len(out["cut"]),
        "finished": None, "by": "tau"}
    assert [e["name"] for e in inside[move_key]] == ["cold_start", "prefill", "decode"]
    assert inside[move_key][1]["args"]["tokens"] == rest.stats.prefill_tokens
    for key, e in ((k, e) for k, es in inside.items() for e in es):
        task = tasks[key]
        assert (e["pid"], e["tid"]) == (task["pid"], task["tid"])
        assert task["ts"] <= e["ts"] and e["ts"] + e["dur"] <= task["ts"] + task["dur"]
    decoded = sum(e["args"]["tokens"] for es in inside.values() for e in es
                  if e["name"] == "decode")
    assert decoded == out["done"].stats.decode_tokens + rest.stats.decode_tokens > 0
