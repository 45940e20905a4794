"""Data-parallel training over the ranks of one ``torch.distributed`` process group.

The trainer pool holds N ranks; every rank holds the policy wrapped by ``wrap_model``:

* ``"fsdp"``: FSDP2 ``fully_shard`` on every decoder layer, on the input embeddings and the
  output head (when they are not tied) and on the root, so parameters, gradients and AdamW
  state live sharded on dimension 0 (1/N of each per rank, as DTensors). Each unit is
  gathered for its forward and again for its backward, and resharded after each; its
  gradient is reduce-scattered at the end of each backward (ZeRO-3). The untied embeddings
  and head are not gathered for their backward: an embedding's backward reads only the ids,
  and the head's (``RankGatheredHead``) takes its weight one rank's rows at a time, so
  neither holds its whole weight and its whole gradient at once;
* ``"ddp"``: ``DistributedDataParallel``: every rank holds everything; gradients all-reduced
  once per update (``sync_gradients``).

With FSDP2 the collectives run inside every forward and backward pass, so every rank must
run the same sequence of passes whatever its share of the batch. An update's micro-batch is
the sequence F (F B)^c B (``ops/engine/forward.py``, ``backward_logprobs``). The ranks agree with
``agree_passes`` (one all-reduce of the counts) on the number of micro-batches and, for each,
on c; a rank short of chunks adds ``zero_loss`` passes, a rank short of micro-batches runs
``idle_micro_batch``. Those passes add exact zeros to the gradients. DDP runs no collective
in the passes (they skip its wrapper) and needs no agreement.
Collectives reduce by mean, so each rank scales its loss by the world size (``loss_scale``)
and the reduced gradient is the gradient of the whole batch's loss.

``split_rows`` spreads a batch over the ranks by token budget, groups (the rows of one prompt)
kept whole so every rank keeps the shared-prompt forward. ``full_state`` gathers the whole
weights (a collective; rank 0 keeps them). ``shard_rows`` says which rows of a dimension-0
sharded tensor a rank holds, for checkpoints written and read per rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ..engine.forward import zero_loss

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
    """The repeated blocks of a Hugging Face model (``_no_split_modules`` names them; sharded
    or not: ``fully_shard`` subclasses a module's class)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules ``wrap_model`` shards one by one before the root: the decoder layers, and
    the input embeddings and output head unless they share their weight."""
    units = decoder_layers(model)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is not None and head is not None and embed.weight is not head.weight:
        units += [embed, head]
    return units


class _HeadLogits(torch.autograd.Function):
    """``hidden @ weight.T`` whose backward does not need ``weight`` gathered: it takes the
    rows of ``head``'s sharded weight from each rank in turn (a broadcast per rank)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, head: torch.nn.Module
                ) -> torch.Tensor:
        ctx.save_for_backward(hidden)  # not weight: FSDP2 frees it after the forward
        ctx.head = head
        return torch.nn.functional.linear(hidden, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # grad: [..., V]
        (hidden,) = ctx.saved_tensors  # [..., H]
        g = grad.reshape(-1, grad.shape[-1])  # [T, V]
        grad_hidden = sum(g[:, start:stop] @ rows.to(g.dtype)
                          for start, stop, rows in rows_by_rank(ctx.head.weight))
        grad_weight = None
        if ctx.needs_input_grad[1]:  # [V, H], reduce-scattered by FSDP2 after this
            grad_weight = g.T @ hidden.reshape(-1, hidden.shape[-1]).to(g.dtype)
        return grad_hidden.reshape(hidden.shape), grad_weight, None


def rows_by_rank(weight: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(start, stop, rows) of a dimension-0 sharded ``weight``, one rank's rows at a time,
    each broadcast from its rank (a collective: every rank iterates it whole); a plain
    tensor is one block."""
    if not is_sharded(weight):
        yield 0, weight.shape[0], weight.detach()
        return
    group = weight.device_mesh.get_group()
    world, me = dist.get_world_size(group), dist.get_rank(group)
    local = weight.to_local().detach()
    for rank in range(world):
        start, stop = shard_rows(weight.shape[0], rank, world)
        if start == stop:
            continue
        rows = local if rank == me else local.new_empty((stop - start, weight.shape[1]))
        dist.broadcast(rows, src=dist.get_global_rank(group, rank), group=group)
        yield start, stop, rows


class RankGatheredHead(torch.nn.Linear):
    """An output head (a bias-free ``nn.Linear``, sharded as its own FSDP2 unit and not
    gathered in backward) whose backward holds at most one rank's rows of the weight and
    then its whole gradient, never the whole weight and gradient at once."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return _HeadLogits.apply(hidden, self.weight, self)


def wrap_model(model: torch.nn.Module, ranks: Ranks) -> torch.nn.Module:
    """``model`` sharded (fsdp, in place: its class becomes FSDP's subclass) or replicated
    (ddp: a wrapper whose ``.module`` is ``model``). Build the optimizer afterwards, over the
    returned module's parameters."""
    if ranks.parallel == "fsdp":
        embed, head = model.get_input_embeddings(), model.get_output_embeddings()
        units = shard_units(model)
        untied = head in units
        if untied and type(head) is torch.nn.Linear and head.bias is None:
            head.__class__ = RankGatheredHead
        for unit in units:
            fully_shard(unit)
        for unit in (embed, head) if untied else ():  # not gathered in backward
            if isinstance(unit, (torch.nn.Embedding, RankGatheredHead)):
                unit.set_unshard_in_backward(False)
        fully_shard(model)
        return model
    if ranks.parallel == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    raise ValueError(f"parallel {ranks.parallel!r}: choose one of {PARALLEL}")


def inner(model: torch.nn.Module) -> torch.nn.Module:
    """The module forward passes run on (a DDP wrapper's ``.module``; else itself)."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) \
        else model


def agree_passes(chunks: list[int], device: torch.device) -> list[int]:
    """Per micro-batch, the most chunk passes any rank runs in it (``chunks``: this rank's
    per micro-batch; a rank without a k-th micro-batch counts -1 there), over as many
    micro-batches as the rank with most has. Every rank gets the same list."""
    count = torch.tensor([len(chunks)], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    per = torch.full((int(count),), -1, dtype=torch.int64, device=device)
    per[:len(chunks)] = torch.tensor(chunks, dtype=torch.int64)
    dist.all_reduce(per, op=dist.ReduceOp.MAX)
    return [max(c, 0) for c in per.tolist()]


def idle_micro_batch(model: torch.nn.Module, pad_id: int, passes: int) -> None:
    """A micro-batch's sequence of passes, F (F B)^passes B, on ``zero_loss`` passes."""
    kept = zero_loss(model, pad_id)
    for _ in range(passes):
        zero_loss(model, pad_id).backward()
    kept.backward()


def sync_gradients(model: torch.nn.Module, pad_id: int) -> None:
    """DDP: all-reduce the gradients accumulated by passes that skipped the wrapper, with one
    ``zero_loss`` pass through it (its hooks reduce). FSDP2 reduced them in each backward."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        zero_loss(model, pad_id).backward()


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
