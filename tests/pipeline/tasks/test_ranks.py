"""Trainer ranks on a real LocalCluster (worker processes, gloo on CPU): one update spread
over 2 ranks gives the gradients of 1 rank's (FSDP2 and DDP), and a checkpoint written by
N ranks restores onto M bitwise (``ops/algo/parallel.py``, ``pipeline/tasks/ranks.py``,
``pipeline/durable/zarr_state.py``); the group's rendezvous store is a file only the run's user can
open, and no rank listens beyond loopback."""

from __future__ import annotations

import os
import random
import shutil
import stat
import subprocess

import psutil
import pyarrow as pa
import pytest
import torch
import zarr
from distributed import Client, LocalCluster
from test_security import LOOPBACK, listening
from transformers import AutoModelForCausalLM

from rlhfless.ops.algo.parallel import (
    decoder_layers,
    full_state,
    full_tensor,
    inner,
    is_sharded,
    split_rows,
    wrap_model,
)
from rlhfless.ops.algo.update import UpdateParams, update_policy
from rlhfless.ops.data.schema import TRAINABLE
from rlhfless.ops.engine.forward import enable_checkpointing
from rlhfless.pipeline.durable import checkpoint as ckpt
from rlhfless.pipeline.durable.zarr_state import get_tensors
from rlhfless.pipeline.tasks.ranks import form_group, interface_of, on_ranks, store_dir, this_rank
from rlhfless.pipeline.tasks.trainer import leave_trainer_task

PARAMS = UpdateParams(lr=1e-2, micro_batch_tokens=96, max_grad_norm=1e9)


def trainable(n_prompts: int = 5, n_samples: int = 3, seed: int = 0) -> pa.Table:
    """Groups of ``n_samples`` rows per prompt, responses of mixed lengths."""
    rng = random.Random(seed)
    prompts, responses = [], []
    for _ in range(n_prompts):
        prompt = [rng.randrange(4, 200) for _ in range(rng.randrange(3, 9))]
        for _ in range(n_samples):
            prompts.append(prompt)
            responses.append([rng.randrange(4, 200) for _ in range(rng.randrange(1, 12))])
    return table_of(prompts, responses, rng)


def uneven_trainable() -> pa.Table:
    """Over 2 ranks, one gets a group of 8 responses of 1..40 tokens (several micro-batches
    and length chunks at ``PARAMS``' budget), the other two groups of 1..3-token responses
    (one micro-batch): their passes differ."""
    rng = random.Random(1)
    prompts = [[rng.randrange(4, 200) for _ in range(6)]] * 8 + [[5, 6, 7]] * 3 + [[8, 9]] * 3
    lengths = [1, 2, 5, 9, 14, 20, 28, 40, 1, 1, 2, 1, 3, 1]
    return table_of(prompts, [[rng.randrange(4, 200) for _ in range(n)] for n in lengths], rng)


def table_of(prompts: list[list[int]], responses: list[list[int]], rng: random.Random
             ) -> pa.Table:
    """A trainable batch of these rows: behaviour log-probabilities near the model's and
    advantages of both signs."""
    n = len(prompts)
    columns = {
        "prompt_id": [f"p{prompts.index(p)}" for p in prompts], "prompt_ids": prompts,
        "answer": [None] * n, "data_source": ["t"] * n,
        "sample_idx": [prompts[:i].count(p) for i, p in enumerate(prompts)],
        "response_ids": responses, "response_text": [""] * n,
        "logprobs": [[-5.0 - 0.1 * rng.random() for _ in r] for r in responses],
        "finish_reason": ["stop"] * n, "policy_version": [0] * n, "worker": ["w"] * n,
        "gen_start": [0.0] * n, "gen_end": [0.0] * n, "reward": [0.0] * n,
        "reward_error": [None] * n, "advantage": [rng.uniform(-1.5, 1.5) for _ in range(n)],
    }
    return pa.Table.from_pydict({f.name: columns[f.name] for f in TRAINABLE}, schema=TRAINABLE)


def load(model_dir) -> torch.nn.Module:
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def one_update(model_dir, table: pa.Table, ranked: bool, device: str = "cpu",
               checkpointed: bool = False) -> dict:
    """One update here (``ranked`` false) or on this rank: metrics, full gradients, weights
    and AdamW state after the step, gathered (on CPU), and the most decoder layers found
    gathered at once when a layer's forward starts. ``device``: "cuda" for the NCCL check of
    bench/gpu_check.sh; ``checkpointed``: with gradient checkpointing."""
    ranks = this_rank() if ranked else None
    model = load(model_dir).to(device)
    if checkpointed:
        enable_checkpointing(model)
    wrapped = model if ranks is None else wrap_model(model, ranks)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=PARAMS.lr, weight_decay=0.0)
    layers, gathered = decoder_layers(inner(wrapped)), [0]

    def count_gathered(*_) -> None:  # FSDP2 swaps a gathered unit's DTensors for tensors
        gathered[0] = max(gathered[0], sum(not is_sharded(next(m.parameters()))
                                           for m in layers))
    hooks = [m.register_forward_pre_hook(count_gathered) for m in layers]
    metrics = update_policy(wrapped, optimizer, table, PARAMS, pad_id=0, ranks=ranks)
    for hook in hooks:
        hook.remove()
    named = dict(inner(wrapped).named_parameters())
    grads = {n: full_tensor(p.grad).cpu() for n, p in named.items()}
    exp_avg = {n: full_tensor(optimizer.state[p]["exp_avg"]).cpu() for n, p in named.items()}
    return {"metrics": metrics, "grads": grads, "weights": full_state(wrapped, keep=True),
            "exp_avg": exp_avg, "gathered_layers": gathered[0]}


def save_after_update(model_dir, table: pa.Table, path: str) -> int:
    """One update on this rank, then this rank's part of a checkpoint at ``path``."""
    ranks = this_rank()
    wrapped = wrap_model(load(model_dir), ranks)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=PARAMS.lr, weight_decay=0.0)
    update_policy(wrapped, optimizer, table, PARAMS, pad_id=0, ranks=ranks)
    return ckpt.write_trainer(path, wrapped, optimizer, ranks)


def restore_full(model_dir, path: str) -> dict:
    """The checkpoint at ``path`` restored onto this rank, gathered back whole."""
    ranks = this_rank()
    wrapped = wrap_model(load(model_dir), ranks)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=PARAMS.lr, weight_decay=0.0)
    ckpt.read_trainer(path, wrapped, optimizer, ranks)
    named = dict(inner(wrapped).named_parameters())
    return {"weights": full_state(wrapped, keep=True),
            "exp_avg": {n: full_tensor(optimizer.state[p]["exp_avg"]).clone()
                        for n, p in named.items()},
            "step": {n: float(optimizer.state[p]["step"]) for n, p in named.items()}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with (LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                       dashboard_address=":0", resources={"TRAIN": 1}) as cluster,
          Client(cluster) as c):
        c.stores = store_dir(tmp_path_factory.mktemp("run"))  # the run's rendezvous stores
        yield c


def group_of(client: Client, world: int, parallel: str) -> list[str]:
    workers = sorted(client.scheduler_info()["workers"])
    return form_group(client, workers[:world], workers, "cpu", parallel, leave_trainer_task,
                      client.stores)


def test_split_rows_keeps_groups_whole_and_balances_tokens():
    table = trainable(n_prompts=7)
    prompts = table.column("prompt_ids").to_pylist()
    lens = [len(r) for r in table.column("response_ids").to_pylist()]
    parts = split_rows(prompts, lens, 3)
    assert sorted(i for part in parts for i in part) == list(range(len(prompts)))
    for part in parts:  # a prompt's rows all on one rank
        assert all(i in part for j in part for i in range(len(prompts))
                   if prompts[i] == prompts[j])
    assert all(part for part in parts)


def adam_step_bound(grad: torch.Tensor, other: torch.Tensor, weight: torch.Tensor
                    ) -> torch.Tensor:
    """How far apart AdamW's first step (no decay) can put one weight, elementwise, when it
    starts from the same value and sees gradient ``grad`` on one side, ``other`` on the other.
    The first step is ``w - lr * g / (|g| + eps)`` (bias-corrected moments ``g`` and ``g²``),
    so the steps differ by ``lr * |f(g) - f(g')|`` with ``f(x) = x / (|x| + eps)`` computed in
    float64, plus float32 rounding: a few ulps of the weight and of the step."""
    eps, tiny = 1e-8, torch.finfo(torch.float32).eps
    g, h = grad.double(), other.double()
    steps = PARAMS.lr * (g / (g.abs() + eps) - h / (h.abs() + eps)).abs()
    return (steps + 4 * tiny * (weight.double().abs() + PARAMS.lr)).float()


def assert_as_one_rank(single: dict, results: list[dict]) -> None:
    for got in results:  # every rank sees the whole gradient and the same weights
        for name, grad in single["grads"].items():  # float32 sums in another order
            scale = grad.abs().max().item()
            err = (got["grads"][name] - grad).abs().max().item()
            assert err <= 1e-5 * scale, (name, err, scale)
        for name, w in single["weights"].items():
            bound = adam_step_bound(got["grads"][name], single["grads"][name], w)
            err = (got["weights"][name] - w).abs()
            assert (err <= bound).all(), (name, (err - bound).max().item())
        for key in ("loss", "pg_loss", "clip_frac"):
            assert got["metrics"][key] == pytest.approx(single["metrics"][key], rel=1e-5)
        assert got["metrics"]["tokens"] == single["metrics"]["tokens"]
        assert got["metrics"]["forward_tokens"] == single["metrics"]["forward_tokens"]
    assert single["metrics"]["grad_norm"] > 0


@pytest.fixture(scope="module")
def untied_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with an output head of its own: its embeddings, perturbed."""
    tied = load(tiny_model_dir)
    config = tied.config
    config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(tied.state_dict())
    torch.manual_seed(0)
    with torch.no_grad():
        model.lm_head.weight.add_(0.01 * torch.randn_like(model.lm_head.weight))
    path = tmp_path_factory.mktemp("untied")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize(("parallel", "head"), [
    ("fsdp", "tied"), ("fsdp", "untied"), pytest.param("ddp", "tied", marks=pytest.mark.slow)])
def test_two_ranks_give_one_ranks_gradients(client, request, parallel, head):
    """Untied, FSDP2 shards the embeddings and the head as units of their own, neither
    gathered in backward (``RankGatheredHead``)."""
    model_dir = request.getfixturevalue(f"{'tiny' if head == 'tied' else head}_model_dir")
    table = trainable()
    single = one_update(model_dir, table, ranked=False)
    members = group_of(client, 2, parallel)
    assert_as_one_rank(single, on_ranks(one_update, model_dir, table, True,
                                        client=client, members=members))


def test_ranks_with_unequal_passes_reshard_and_give_one_ranks_gradients(client,
                                                                        tiny_model_dir):
    """FSDP2 ranks whose shares differ in micro-batches and chunk passes pad with zero-loss
    passes, so each unit can be gathered per pass and resharded after it: at most one layer
    is gathered when a layer's forward starts, and the gradients are 1 rank's."""
    table = uneven_trainable()
    single = one_update(tiny_model_dir, table, ranked=False)
    results = on_ranks(one_update, tiny_model_dir, table, True, client=client,
                       members=group_of(client, 2, "fsdp"))
    assert_as_one_rank(single, results)
    assert results[0]["metrics"]["padding_passes"] > 0
    assert single["metrics"]["padding_passes"] == 0
    assert [r["gathered_layers"] for r in results] == [1, 1]


@pytest.mark.slow
def test_ranks_with_unequal_passes_and_gradient_checkpointing(client, tiny_model_dir):
    """Rows run whole under gradient checkpointing (one pass per micro-batch, layers
    recomputed in the backward): the padded ranks still give 1 rank's gradients."""
    table = uneven_trainable()
    single = one_update(tiny_model_dir, table, False, "cpu", True)
    results = on_ranks(one_update, tiny_model_dir, table, True, "cpu", True, client=client,
                       members=group_of(client, 2, "fsdp"))
    assert_as_one_rank(single, results)
    assert results[0]["metrics"]["padding_passes"] > 0


@pytest.mark.parametrize(("write", "read"), [(2, 1), (1, 2)])
def test_checkpoint_of_n_ranks_restores_on_m_bitwise(client, tiny_model_dir, tmp_path,
                                                     write, read):
    path = ckpt.begin(tmp_path, 1)
    members = group_of(client, write, "fsdp")
    on_ranks(save_after_update, tiny_model_dir, trainable(), str(path), client=client,
             members=members)
    zarr.open_group(path, mode="r+").attrs["policy_version"] = 1
    stored = get_tensors(zarr.open_group(path, mode="r")["trainer/model"])
    path = ckpt.commit(path)
    members = group_of(client, read, "fsdp")
    for got in on_ranks(restore_full, tiny_model_dir, str(path), client=client,
                        members=members):
        assert got["weights"].keys() == stored.keys()
        for name, tensor in stored.items():
            assert torch.equal(got["weights"][name], tensor), name
        assert set(got["step"].values()) == {1.0}
        opt = zarr.open_group(path, mode="r")["trainer/optimizer"]
        for name, tensor in got["exp_avg"].items():
            assert torch.equal(tensor, get_tensors(opt[name])["exp_avg"]), name


def own_listening() -> set[str]:
    return listening(os.getpid())


def as_nobody(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                           *command], capture_output=True)


def test_the_rendezvous_is_private_and_nothing_listens_beyond_loopback(client):
    members = group_of(client, 2, "ddp")
    assert on_ranks(this_rank_number, client=client, members=members) == [0, 1]
    for addresses in on_ranks(own_listening, client=client, members=members):
        assert addresses and addresses <= LOOPBACK, addresses  # Dask's, gloo's: loopback
    stores = list(client.stores.glob("store-*"))
    assert len(stores) == 1  # the live group's; those of groups left are gone
    assert stat.S_IMODE(client.stores.stat().st_mode) == 0o700
    if os.geteuid() == 0 and shutil.which("setpriv"):  # another user reads or sets no key
        for command in (["cat", str(stores[0])], ["sh", "-c", f"echo x >> {stores[0]}"],
                        ["ls", str(client.stores)]):
            other = as_nobody(*command)
            assert other.returncode != 0 and b"Permission denied" in other.stderr, command


def test_collectives_bind_to_the_interface_that_holds_the_address():
    loopback = interface_of("127.0.0.1")
    held = {a.address for a in psutil.net_if_addrs()[loopback]}
    assert "127.0.0.1" in held and interface_of("localhost") == loopback
    assert interface_of("192.0.2.1") is None  # TEST-NET-1: no interface holds it


def this_rank_number() -> int:
    return this_rank().rank
