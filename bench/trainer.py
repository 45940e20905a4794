"""Trainer ranks: one update on 1 rank vs 2 ranks (FSDP2 and DDP, gloo on CPU), and LoRA's
published bytes vs the full weights'.

A bench-size Llama (``--hidden``, ``--layers``; random weights, built here) and one synthetic
batch (``--prompts`` groups of ``--samples`` rows, responses of 8..``--max-response``
tokens, advantages of both signs) go to worker processes of one ``LocalCluster`` with one
torch thread each. Every variant runs ``--updates`` updates after one warm-up; printed per
variant: tokens (prompt + response, as the update counts them) per second of the median
update, and the bytes each rank holds in parameters + gradients + AdamW state: after the
step (``param_grad_optimizer_bytes_per_rank``: a DTensor counts its local shard), and the
peak during the update (``peak_update_bytes_per_rank``): the bytes of the distinct storages
behind the parameters, their gradients and the optimizer state, sampled after every step
and, with FSDP2, at every unit's post-forward (the unit gathered) and post-backward (its
unsharded gradient complete, before the reduce-scatter; the next unit may be prefetched)
and at each rank's rows the untied head's backward receives (``rows_by_rank``), counting
the gathered parameters, received rows and unsharded gradients alive then. Activations, the
all-gather and reduce-scatter buffers and DDP's gradient buckets are not counted. For FSDP2
also ``largest_unit_bytes``: the full parameter bytes of the largest sharded unit.
``lora``: bytes of a published version with adapters of rank ``--lora-rank`` on
q/k/v/o_proj vs without. One JSON line.

    python bench/trainer.py [--hidden 256] [--layers 4] [--prompts 8] [--updates 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import torch
from distributed import Client, LocalCluster
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from rlhfless.ops.algo import parallel
from rlhfless.ops.algo.parallel import Ranks, inner, local_part, wrap_model
from rlhfless.ops.algo.update import UpdateParams, update_policy
from rlhfless.ops.data.schema import TRAINABLE
from rlhfless.ops.engine.lora import LoraSpec, add_adapters
from rlhfless.ops.engine.publish import publish_weights
from rlhfless.pipeline.tasks.ranks import form_group, on_ranks, store_dir, this_rank
from rlhfless.pipeline.tasks.trainer import leave_trainer_task

PARAMS = UpdateParams(lr=1e-4, micro_batch_tokens=1024)


def build_model(out: Path, hidden: int, layers: int) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=max(1, hidden // 128), max_position_embeddings=512,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def synthetic_batch(prompts: int, samples: int, max_response: int, seed: int = 0) -> pa.Table:
    rng = random.Random(seed)
    cols: dict[str, list] = {f.name: [] for f in TRAINABLE}
    for g in range(prompts):
        prompt = [rng.randrange(4, 4096) for _ in range(rng.randrange(16, 48))]
        for s in range(samples):
            response = [rng.randrange(4, 4096) for _ in range(rng.randrange(8, max_response))]
            row = {"prompt_id": f"p{g}", "prompt_ids": prompt, "answer": None,
                   "data_source": "bench", "sample_idx": s, "response_ids": response,
                   "response_text": "", "logprobs": [-8.3] * len(response),
                   "finish_reason": "stop", "policy_version": 0, "worker": "w",
                   "gen_start": 0.0, "gen_end": 0.0, "reward": 0.0, "reward_error": None,
                   "advantage": rng.uniform(-1, 1)}
            for k, v in row.items():
                cols[k].append(v)
    return pa.Table.from_pydict(cols, schema=TRAINABLE)


def _bytes(tensors) -> int:
    return sum(local_part(t).numel() * local_part(t).element_size() for t in tensors)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct live storages behind ``tensors`` (a DTensor: its local shard)."""
    sizes: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            storage = local_part(t).untyped_storage()
            if storage.data_ptr():
                sizes[storage.data_ptr()] = max(sizes.get(storage.data_ptr(), 0),
                                                storage.nbytes())
    return sum(sizes.values())


class PeakDuringUpdate:
    """The largest parameter + gradient + optimizer-state bytes this process held at the
    samples of the module docstring (FSDP2's hooks wrapped while inside the ``with``)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer, self.peak = model, optimizer, 0
        self.fsdp_params = [fp for m in model.modules() if isinstance(m, FSDPModule)
                            for group in [m._get_fsdp_state()._fsdp_param_group] if group
                            for fp in group.fsdp_params]

    def sample(self, received: torch.Tensor | None = None) -> None:
        tensors = [received] + [t for p in self.model.parameters() for t in (p, p.grad)]
        tensors += [t for s in self.optimizer.state.values() for t in s.values()
                    if torch.is_tensor(t) and t.dim()]
        for fp in self.fsdp_params:
            unsharded = getattr(fp, "_unsharded_param", None)
            tensors += [fp.sharded_param, fp.sharded_param.grad, unsharded,
                        None if unsharded is None else unsharded.grad,
                        fp.unsharded_accumulated_grad]
        self.peak = max(self.peak, _storage_bytes(tensors))

    def __enter__(self) -> PeakDuringUpdate:
        self.saved = {name: getattr(FSDPParamGroup, name)
                      for name in ("post_forward", "post_backward")}
        for name, original in self.saved.items():
            def sampled(group, *args, _original=original):
                self.sample()
                return _original(group, *args)
            setattr(FSDPParamGroup, name, sampled)

        def sampled_rows(weight, _original=parallel.rows_by_rank):
            for start, stop, rows in _original(weight):
                self.sample(rows)
                yield start, stop, rows
        self.rows_by_rank, parallel.rows_by_rank = parallel.rows_by_rank, sampled_rows
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self.saved.items():
            setattr(FSDPParamGroup, name, original)
        parallel.rows_by_rank = self.rows_by_rank


def run_updates(model_dir: str, batch: pa.Table, ranked: bool, updates: int) -> dict:
    """Warm-up + ``updates`` updates on this worker (as a rank if ``ranked``)."""
    torch.set_num_threads(1)
    ranks: Ranks | None = this_rank() if ranked else None
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    wrapped = model if ranks is None else wrap_model(model, ranks)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=PARAMS.lr, weight_decay=0.0)
    seconds, tokens = [], 0
    with PeakDuringUpdate(inner(wrapped), optimizer) as peak:
        for i in range(updates + 1):
            started = time.perf_counter()
            metrics = update_policy(wrapped, optimizer, batch, PARAMS, pad_id=0, ranks=ranks)
            if i:
                seconds.append(time.perf_counter() - started)
            tokens = metrics["forward_tokens"]
            peak.sample()
    params = list(inner(wrapped).parameters())
    state = {"param": _bytes(params), "grad": _bytes(p.grad for p in params),
             "optimizer": _bytes(t for s in optimizer.state.values() for t in s.values()
                                 if torch.is_tensor(t) and t.dim())}
    units = [m for m in inner(wrapped).modules() if isinstance(m, FSDPModule)]
    largest = max((sum(p.numel() * p.element_size() for p in m.parameters())
                   for m in units if m is not inner(wrapped)), default=0)
    return {"seconds": statistics.median(seconds), "tokens": tokens, **state,
            "total": sum(state.values()), "peak": peak.peak, "largest_unit": largest}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-response", type=int, default=40)
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--lora-rank", type=int, default=8)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-trainer-"))
    model_dir = str(build_model(tmp / "model", args.hidden, args.layers))
    batch = synthetic_batch(args.prompts, args.samples, args.max_response)
    out: dict = {"bench": "trainer", "hidden": args.hidden, "layers": args.layers,
                 "load_1min": os.getloadavg()[0]}
    with (LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                       dashboard_address=":0") as cluster, Client(cluster) as client):
        workers = sorted(client.scheduler_info()["workers"])
        one = client.submit(run_updates, model_dir, batch, False, args.updates,
                            workers=[workers[0]], pure=False).result()
        variants = {"1_rank": one}
        for parallel in ("fsdp", "ddp"):
            members = form_group(client, workers, workers, "cpu", parallel, leave_trainer_task,
                                 store_dir(tmp))
            per_rank = on_ranks(run_updates, model_dir, batch, True, args.updates,
                                client=client, members=members)
            variants[f"2_ranks_{parallel}"] = max(per_rank, key=lambda r: r["peak"])
    for name, r in variants.items():
        out[name] = {"tokens_per_s": round(r["tokens"] / r["seconds"], 1),
                     "update_s": round(r["seconds"], 3),
                     "param_grad_optimizer_bytes_per_rank": r["total"],
                     "vs_1_rank": round(r["total"] / one["total"], 3),
                     "peak_update_bytes_per_rank": r["peak"],
                     "peak_vs_1_rank": round(r["peak"] / one["peak"], 3),
                     "largest_unit_bytes": r["largest_unit"]}
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    full = Path(publish_weights(model, tmp / "full", 1).path).stat().st_size
    add_adapters(model, LoraSpec(args.lora_rank, 2.0 * args.lora_rank))
    lora = sum(f.stat().st_size  # the adapter directory's tensors and config
               for f in Path(publish_weights(model, tmp / "lora", 1).path).iterdir())
    out["lora"] = {"rank": args.lora_rank, "published_bytes": lora, "full_bytes": full,
                   "ratio": round(lora / full, 4)}
    shutil.rmtree(tmp)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
