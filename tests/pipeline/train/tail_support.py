"""One elastic iteration on two float64 generation workers, checked against uninterrupted
decoding: the harness of the tail tests (``test_kv_elastic.py``, ``test_tail_actions.py``).

``elastic_iteration`` runs ``ElasticGeneration.run_generation`` on 8 prompts, sampling, under
a given scaling policy (priors that make a KV transfer the cheaper path of a move) and
``tail_action``, and checks that every (prompt, sample) comes out once, token for token as one
worker decoding the whole batch uninterrupted (every draw is keyed by the run seed, the
iteration, the prompt and the sample: ``ops/engine/seeds.py``), log-probabilities within
1e-5 (float64 decoding; a moved or widened decode reorders float64 sums only), with nothing
left paused on any worker and every worker at its own thread count afterwards.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pyarrow as pa
import torch
from transformers import AutoTokenizer

from rlhfless.ops.data.load import read_prompts
from rlhfless.ops.data.prefix_dedup import plan_prefixes
from rlhfless.ops.engine.engine_types import SamplingParams, WeightsRef
from rlhfless.ops.engine.gen_stats import Generated
from rlhfless.ops.engine.seeds import generation_seed
from rlhfless.pipeline.cluster.pools import Pool, PoolCluster
from rlhfless.pipeline.config import Config
from rlhfless.pipeline.durable.runs import RunDir
from rlhfless.pipeline.specs import make_specs
from rlhfless.pipeline.tasks.rollout import PAUSED, generate_chunk_task, generation_engine
from rlhfless.pipeline.train.elastic import ElasticGeneration
from rlhfless.schedulers.ledger import CostLedger
from rlhfless.schedulers.scaling_policy import ScalingPolicy
from rlhfless.schedulers.tail_cost import TransferModel

N_SAMPLES, MAX_NEW = 3, 24


def paused_keys() -> list[str]:
    """On a worker: the paused decodings it holds."""
    return list(PAUSED)


def float64_engine(spec, weights) -> str:
    engine, _, _ = generation_engine(spec.engine, weights)
    engine.model.double()
    return str(engine.model.dtype)


def unique_pairs(table: pa.Table) -> dict:
    pairs = list(zip(table.column("prompt_id").to_pylist(), table.column("sample_idx").to_pylist()))
    counts = Counter(pairs)
    assert set(counts.values()) == {1}, counts  # each (prompt, sample) exactly once
    return dict(zip(pairs, zip(table.column("response_ids").to_pylist(),
                               table.column("logprobs").to_pylist())))


def elastic_iteration(model_dir, tmp_path, policy_type=ScalingPolicy,
                      generation=ElasticGeneration, tail_action: str = "auto"):
    """One elastic iteration of 8 prompts on two float64 generation workers, sampling, by
    ``generation`` under a ``policy_type`` whose priors make a KV transfer the cheaper path
    of a move; checks that every (prompt, sample) comes out once, as one worker decoding the
    whole batch uninterrupted; returns the run, the generation facts, the policy and the
    configuration."""
    cfg = Config(model=str(model_dir), runs_dir=str(tmp_path), name="kv", n_samples=N_SAMPLES,
                 max_new_tokens=MAX_NEW, batch_prompts=8, policy="elastic", gen_workers=2,
                 lambda_cost=1.0, tau=0.3, keep_alive_s=0.0, train_threads=1,
                 tail_action=tail_action)
    run = RunDir.create(cfg)
    specs = make_specs(cfg, model_dir, run)
    specs = dataclasses.replace(specs, gen=dataclasses.replace(
        specs.gen, sampling=SamplingParams(MAX_NEW, temperature=1.0)))
    weights = WeightsRef(0, str(model_dir))
    scaling = policy_type(cfg.scaling_knobs(), transfer=TransferModel(
        prior_latency_s=0.0, prior_bytes_per_s=1e12))
    tok = AutoTokenizer.from_pretrained(model_dir)
    batch = read_prompts(model_dir / "train.jsonl", tok).table.slice(0, 8)
    pools = [Pool("gen", 2, 1, {"GEN": 1}, "2GiB"), Pool("train", 1, 1, {"TRAIN": 1}, "2GiB")]
    with PoolCluster(pools, CostLedger({"gen": 1.0, "train": 1.0})) as pc:
        c = pc.client
        addrs = [pc.address_of(n) for n in pc.worker_names("gen")]
        for a in addrs:
            assert c.submit(float64_engine, specs.gen, weights, workers=[a],
                            pure=False).result() == "torch.float64"
        prompts = plan_prefixes(batch, N_SAMPLES, cfg.min_prefix).prompts
        whole = c.submit(generate_chunk_task, prompts, weights, specs.gen,
                         generation_seed(0, 1), 1.0, "whole",
                         workers=[addrs[0]], pure=False).result()
        assert len(whole["cut"]) == 0
        eg = generation(pc, cfg, run, scaling)
        _, trainables, facts = eg.run_generation(batch, weights, 1, specs, seed=0)
        tables = c.gather(trainables)
        left = c.run(paused_keys, workers=[pc.address_of(n) for n in pc.worker_names("gen")])
        assert not any(left.values()), left  # nothing left paused on any worker
        threads = c.run(torch.get_num_threads)
        assert set(threads.values()) == {1}, threads  # a widened worker is given its own back
    got = unique_pairs(Generated.concat(tables).table)
    reference = unique_pairs(whole["done"].table)
    assert got.keys() == reference.keys() and len(got) == len(batch) * N_SAMPLES
    for pair, (ids, lps) in reference.items():
        assert got[pair][0] == ids, pair  # token for token
        assert max((abs(x - y) for x, y in zip(got[pair][1], lps)), default=0.0) < 1e-5
    return run, facts, scaling, cfg
