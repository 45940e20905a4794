"""Data-parallel training over the ranks of one ``torch.distributed`` process group.

The trainer pool holds N ranks; every rank holds the policy wrapped by ``wrap_model``:

* ``"fsdp"``: FSDP2 ``fully_shard`` on every decoder layer and on the root, so parameters,
  gradients and AdamW state live sharded on dimension 0 (1/N of each per rank, as DTensors)
  between updates;
* ``"ddp"``: ``DistributedDataParallel``: every rank holds everything; gradients all-reduced.

One update (``ops/update.py``) runs the same schedule on every rank, whatever its share of
the batch:

    begin_accumulation     fsdp: all-gather every layer once, keep it gathered; no grad sync
    rank's micro-batches   any number of forward passes each (the shared-prompt forward runs
                           one pass per prompt batch and one per length chunk), no collectives
    sync_gradients         one tiny forward + backward with sync on: the accumulated gradients
                           are reduce-scattered (fsdp) or all-reduced (ddp), then resharded

so ranks with different numbers of micro-batches or forward passes never disagree on the
sequence of collectives. The cost: during an update each rank holds the gathered parameters
and their unsharded gradients (as ZeRO-2 would); between updates only its shards.
Collectives reduce by mean, so each rank scales its loss by the world size (``loss_scale``)
and the reduced gradient is the gradient of the whole batch's loss.

``split_rows`` spreads a batch over the ranks by token budget, groups (the rows of one prompt)
kept whole so every rank keeps the shared-prompt forward. ``full_state`` gathers the whole
weights (a collective; rank 0 keeps them). ``shard_rows`` says which rows of a dimension-0
sharded tensor a rank holds, for checkpoints written and read per rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

PARALLEL = ("fsdp", "ddp")


@dataclass(frozen=True)
class Ranks:
    """This process's place in the trainer's process group."""

    rank: int
    world: int
    parallel: str = "fsdp"  # one of PARALLEL

    @property
    def loss_scale(self) -> float:
        """Collectives average over ranks; the loss must sum over the batch."""
        return float(self.world)


def split_rows(prompts: list[list[int]], response_lens: list[int], world: int
               ) -> list[list[int]]:
    """Row indices per rank. Rows with the same prompt form a group and go to one rank;
    groups are placed largest first (prompt + responses tokens) on the rank with the fewest
    tokens so far, ties to the lowest rank. Deterministic: every rank computes the same split."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt), []).append(i)
    cost = {key: len(key) + sum(response_lens[i] for i in rows) for key, rows in groups.items()}
    load, out = [0] * world, [[] for _ in range(world)]
    for key in sorted(groups, key=lambda k: (-cost[k], groups[k][0])):
        r = min(range(world), key=lambda j: (load[j], j))
        load[r] += cost[key]
        out[r] += groups[key]
    return [sorted(rows) for rows in out]


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face model (``_no_split_modules`` names them)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def wrap_model(model: torch.nn.Module, ranks: Ranks) -> torch.nn.Module:
    """``model`` sharded (fsdp, in place: its class becomes FSDP's subclass) or replicated
    (ddp: a wrapper whose ``.module`` is ``model``). Build the optimizer afterwards, over the
    returned module's parameters."""
    if ranks.parallel == "fsdp":
        for layer in decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        return model
    if ranks.parallel == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    raise ValueError(f"parallel {ranks.parallel!r}: choose one of {PARALLEL}")


def inner(model: torch.nn.Module) -> torch.nn.Module:
    """The module forward passes run on (a DDP wrapper's ``.module``; else itself)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) \
        else model


def _fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def begin_accumulation(model: torch.nn.Module) -> None:
    """Before a rank's micro-batches: no collective until ``sync_gradients``."""
    for m in _fsdp_modules(model):  # same order on every rank: the all-gathers match
        m.set_reshard_after_forward(False, recurse=False)
        m.set_reshard_after_backward(False, recurse=False)
        m.set_requires_gradient_sync(False, recurse=False)
        m.unshard()


def sync_gradients(model: torch.nn.Module, pad_id: int) -> None:
    """Reduce the gradients accumulated since ``begin_accumulation`` over the ranks: one
    forward + backward of a one-token input whose loss is 0 (it adds zeros to every
    gradient) with sync on, through the wrapper so that its hooks reduce."""
    fsdp = _fsdp_modules(model)
    for m in fsdp:
        m.set_requires_gradient_sync(True, recurse=False)
        m.set_reshard_after_backward(True, recurse=False)
    device = next(model.parameters()).device
    out = model(input_ids=torch.full((1, 1), pad_id, dtype=torch.long, device=device))
    (out.logits.float().sum() * 0.0).backward()
    for m in fsdp:
        m.set_reshard_after_forward(True, recurse=False)


def all_reduce_sum(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """``values`` summed over the ranks (same keys on every rank)."""
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor: every rank must call it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state(model: torch.nn.Module, keep: bool,
               names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The module's whole ``state_dict`` (only ``names``, if given) on CPU, gathered tensor
    by tensor (every rank calls it, in the same order); ranks with ``keep`` false drop each
    tensor once gathered and get ``{}``."""
    out, seen = {}, set()
    for name, t in inner(model).state_dict(keep_vars=True).items():
        if id(t) in seen or names is not None and name not in names:  # tied: once
            continue
        seen.add(id(t))
        whole = full_tensor(t.detach())
        if keep:
            out[name] = whole.cpu()
    return out


def shard_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of the rows of a dimension-0 shard: ``torch.chunk``'s split, as FSDP2
    shards (ceil(rows / world) rows per rank, the last ranks short or empty)."""
    per = math.ceil(rows / world) if rows else 0
    return min(rank * per, rows), min((rank + 1) * per, rows)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of ``t`` (a DTensor's local shard; a plain tensor is all local)."""
    return t.to_local() if isinstance(t, DTensor) else t


def is_sharded(t: torch.Tensor) -> bool:
    return isinstance(t, DTensor)
