"""Checkpoint store: bit-exact tensors, optimizer/RNG/predictor state, atomic commit,
partial checkpoints detected, pruning, no unpickling, Hugging Face export."""

from __future__ import annotations

import itertools
import json
import pickle
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhfless.pipeline.cli import main
from rlhfless.pipeline.durable import checkpoint as ckpt
from rlhfless.pipeline.durable.export import export_hf
from rlhfless.pipeline.durable.recovery import trim_run
from rlhfless.pipeline.durable.runs import RunDir
from rlhfless.pipeline.durable.zarr_state import (
    CHUNK_KEYS,
    TORCH_DTYPES,
    chunk_rows,
    chunk_shape,
    get_tensors,
    get_tree,
    model_tensors,
    put_array,
    put_rng,
    put_tensors,
    put_tree,
    set_rng,
)
from rlhfless.schedulers.predictor import LengthPredictor
from rlhfless.schedulers.throughput import ThroughputModel

_COUNTER = itertools.count()


def group(tmp_path: Path) -> zarr.Group:
    return zarr.open_group(tmp_path / f"g{next(_COUNTER)}", mode="w", zarr_format=3)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, so that NaN payloads and -0.0 compare too."""
    return t.reshape(-1).contiguous().view(torch.uint8) if t.numel() else t.reshape(-1)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bit patterns (NaN, inf and subnormals included) of any dtype."""
    n = int(np.prod(shape, dtype=np.int64))
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    size = torch.empty(0, dtype=dtype).element_size()
    raw = np.random.default_rng(seed).integers(0, 256, n * size, dtype=np.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    return torch.from_numpy(raw).view(dtype).reshape(shape)


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(sorted(TORCH_DTYPES)),
       shape=st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple),
       seed=st.integers(0, 2**31))
def test_tensor_round_trip_is_bit_exact(tmp_path_factory, dtype, shape, seed):
    t = random_tensor(TORCH_DTYPES[dtype], shape, seed)
    g = group(tmp_path_factory.mktemp("t"))
    put_tensors(g, {"x": t})
    back = get_tensors(zarr.open_group(g.store, mode="r"))["x"]
    assert back.dtype == t.dtype and back.shape == t.shape
    assert torch.equal(bits(back), bits(t))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5000), cols=st.integers(1, 300), limit=st.integers(64, 1 << 16))
def test_chunk_rows_fit_and_prefer_divisors(rows, cols, limit):
    r = chunk_rows((rows, cols), 2, limit)
    assert 1 <= r <= rows
    assert r * cols * 2 <= limit or r == 1
    if rows * cols * 2 <= limit:
        assert r == rows  # one chunk when it fits


def test_predictor_and_throughput_state_round_trip(tmp_path):
    pred = LengthPredictor(alpha=0.3)
    pred.observe(["a", "b", "a"], [5, 9, 7])
    pred.observe(["c"], [11])
    tput = ThroughputModel()
    tput.observe_decode(8, 0.02, n_steps=5)
    tput.observe_prefill(100, 0.1)
    g = group(tmp_path)
    put_tree(g.create_group("p"), pred.state_dict())
    put_tree(g.create_group("t"), tput.state_dict())
    p2, t2 = LengthPredictor(alpha=0.3), ThroughputModel()
    p2.load_state_dict(get_tree(g["p"]))
    t2.load_state_dict(get_tree(g["t"]))
    assert p2.state_dict() == pred.state_dict()
    assert t2.state_dict() == tput.state_dict()
    assert ThroughputModel().state_dict()["cold_start_s"] is None  # None survives too
    put_tree(g.create_group("empty"), ThroughputModel().state_dict())
    assert get_tree(g["empty"]) == ThroughputModel().state_dict()


def test_rng_states_restore_every_generator(tmp_path):
    g = group(tmp_path)
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    np.random.normal()  # a cached gaussian is part of numpy's state
    put_rng(g)
    first = (torch.rand(4), np.random.rand(4), np.random.normal(), random.random())
    set_rng(zarr.open_group(g.store, mode="r"))
    again = (torch.rand(4), np.random.rand(4), np.random.normal(), random.random())
    assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1])
    assert first[2:] == again[2:]


class Tied(torch.nn.Module):
    """Tied input/output embeddings and a bf16 layer, like a small LM."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.mid = torch.nn.Linear(6, 6).to(torch.bfloat16)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.embed(ids).to(torch.bfloat16)).float()
        return self.head(h)


def steps(model: Tied, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        ids = torch.randint(0, 11, (4, 5))  # draws from the torch RNG: restored too
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()


def save(root: Path, iteration: int, model, opt, **driver) -> Path:
    tmp = ckpt.begin(root, iteration)
    ckpt.write_trainer(tmp, model, opt)
    state = ckpt.DriverState(iteration=iteration, policy_version=iteration,
                             sampler_position=4 * iteration, predictor={}, throughput={},
                             **driver)
    ckpt.write_driver(tmp, state)
    return ckpt.commit(tmp)


def test_restored_trainer_continues_bitwise(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps(model, opt, 3)
    path = save(tmp_path, 3, model, opt)
    steps(model, opt, 2)
    torch.manual_seed(123)  # a different process state
    fresh = Tied()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert ckpt.read_trainer(path, fresh, fresh_opt) == 3
    steps(fresh, fresh_opt, 2)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(bits(a), bits(b)), name
    assert "head.weight" not in model_tensors(model)  # tied: stored once


def test_commit_is_atomic_and_partial_checkpoints_fall_back(tmp_path):
    model = Tied()
    opt = torch.optim.AdamW(model.parameters())
    steps(model, opt, 1)
    save(tmp_path, 1, model, opt)
    save(tmp_path, 2, model, opt)
    # a crash after the rename but before the marker (or a partial copy): no COMMITTED
    unmarked = save(tmp_path, 3, model, opt)
    (unmarked / ckpt.MARKER).unlink()
    # a crash mid-write: the temporary directory is never a candidate
    ckpt.write_trainer(ckpt.begin(tmp_path, 4), model, opt)
    path, skipped = ckpt.latest(tmp_path)
    assert path.name == "iter-00002"
    assert len(skipped) == 1 and "iter-00003" in skipped[0] and "COMMITTED" in skipped[0]
    with pytest.raises(ValueError, match="iter-00003.*COMMITTED"):
        ckpt.read_driver(unmarked)
    # a truncated chunk in the newest whole one: detected by the manifest's sizes
    chunk = next((path / "trainer" / "model").rglob("c.*"))
    chunk.write_bytes(chunk.read_bytes()[:-1])
    path, skipped = ckpt.latest(tmp_path)
    assert path.name == "iter-00001" and "bytes" in skipped[-1]
    assert ckpt.read_driver(path).sampler_position == 4


def overwrite_in_place(chunk: Path) -> None:
    """A stray write: every byte of ``chunk`` set to 0xFF (NaN in float32 and bfloat16),
    the size unchanged."""
    size = chunk.stat().st_size
    with open(chunk, "r+b") as f:
        f.write(b"\xff" * size)
    assert chunk.stat().st_size == size


def test_a_chunk_overwritten_in_place_falls_back_to_the_previous_checkpoint(tmp_path):
    """Sizes alone passed this: resume then loaded NaN weights, every time."""
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters())
    steps(model, opt, 1)
    save(tmp_path, 1, model, opt)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    steps(model, opt, 1)
    newest = save(tmp_path, 2, model, opt)
    overwrite_in_place(next((newest / "trainer" / "model" / "mid.weight").glob("c.*")))
    assert ckpt.problem(newest, content=False) is None  # the sizes still match
    path, skipped = ckpt.latest(tmp_path)
    assert path.name == "iter-00001"
    assert len(skipped) == 1 and "\n" not in skipped[0]
    assert "iter-00002" in skipped[0] and "mid.weight" in skipped[0] and "CRC32C" in skipped[0]
    fresh = Tied()
    ckpt.read_trainer(path, fresh, torch.optim.AdamW(fresh.parameters()))
    for name, tensor in fresh.state_dict().items():
        assert torch.isfinite(tensor.float()).all() and torch.equal(tensor, good[name]), name
    with pytest.raises(ValueError, match="CRC32C"):
        export_hf(newest, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_manifest_of_format_1_is_still_read_by_its_sizes(tmp_path):
    model = Tied()
    opt = torch.optim.AdamW(model.parameters())
    path = save(tmp_path, 1, model, opt)
    manifest = json.loads((path / ckpt.MARKER).read_text())
    manifest["format_version"] = 1
    manifest["files"] = {rel: e["bytes"] for rel, e in manifest["files"].items()}
    (path / ckpt.MARKER).write_text(json.dumps(manifest))
    assert ckpt.latest(tmp_path) == (path, [])


def test_export_refuses_a_damaged_checkpoint_in_one_line(tiny_model_dir, tmp_path, capsys):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    run = tmp_path / "run"
    path = save(run / "checkpoints", 3, model, torch.optim.AdamW(model.parameters()),
                model_path=str(tiny_model_dir))
    overwrite_in_place(next((path / "trainer" / "model").rglob("c.*")))
    capsys.readouterr()
    assert main(["export", str(run), "-o", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert "iter-00003" in err and "CRC32C" in err and "--iteration" in err and "\n" not in err
    assert not (tmp_path / "hf").exists()


def test_prune_keeps_the_newest_whole_ones(tmp_path):
    model = Tied()
    opt = torch.optim.AdamW(model.parameters())
    for it in range(5):
        save(tmp_path, it, model, opt)
    (tmp_path / "iter-00004" / ckpt.MARKER).unlink()
    ckpt.begin(tmp_path, 5)
    removed = ckpt.prune(tmp_path, keep=2)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["iter-00002", "iter-00003"], (left, removed)
    save(tmp_path, 3, model, opt)  # committing over an existing one replaces it
    assert ckpt.problem(tmp_path / "iter-00003") is None
    with pytest.raises(ValueError, match="keep"):
        ckpt.prune(tmp_path, keep=0)


def test_prune_keeps_one_at_or_before_each_anchor_and_latest_looks_back(tmp_path):
    """The collapse guard's good states (``anchors``) outlive ``keep_checkpoints``."""
    model = Tied()
    opt = torch.optim.AdamW(model.parameters())
    for it in range(0, 25, 5):
        save(tmp_path, it, model, opt)
    ckpt.prune(tmp_path, keep=2, anchors=(7, 20))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter-00005", "iter-00015",
                                                          "iter-00020"]
    assert ckpt.latest(tmp_path, at_most=14)[0].name == "iter-00005"
    assert ckpt.latest(tmp_path, at_most=4)[0] is None


def test_loading_never_unpickles(tmp_path, monkeypatch):
    model = Tied()
    opt = torch.optim.AdamW(model.parameters())
    steps(model, opt, 1)
    table = pa.table({"prompt_id": ["a", "b"], "reward": [1.0, 0.0]})
    path = save(tmp_path, 1, model, opt, tables={"replay": table},
                ledger_totals={"cost": 1.5})

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint load unpickled something")

    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"),
                         (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    state = ckpt.read_driver(path)
    assert state.tables["replay"].equals(table) and state.ledger_totals == {"cost": 1.5}
    fresh = Tied()
    ckpt.read_trainer(path, fresh, torch.optim.AdamW(fresh.parameters()))
    assert torch.equal(fresh.embed.weight, model.embed.weight)


def test_export_hf_loads_with_transformers(tiny_model_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.tensor([[1, 5, 7, 9]])
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    path = save(tmp_path / "checkpoints", 1, model, opt, model_path=str(tiny_model_dir))
    out = export_hf(ckpt.find(tmp_path), tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert AutoTokenizer.from_pretrained(out).pad_token_id is not None
    assert path.name == "iter-00001"
    with pytest.raises(FileNotFoundError, match="whole ones"):
        ckpt.find(tmp_path, iteration=7)


@pytest.mark.parametrize("dtype, shape", [("float32", (5, 3)), ("uint16", (70, 2)),
                                          ("bool", (4,)), ("float64", ()), ("uint8", (0,)),
                                          ("int64", (3, 0, 2)), ("float16", (2, 2, 2))])
def test_direct_writes_match_what_zarr_writes(tmp_path, dtype, shape):
    a = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape).astype(dtype)
    ours = group(tmp_path)
    put_array(ours, "x", a, {"torch_dtype": "t"}, limit=64)
    chunks = chunk_shape(a.shape, a.itemsize, limit=64)
    theirs = group(tmp_path)
    array = theirs.create_array("x", shape=shape, dtype=dtype, chunks=chunks,
                                compressors=None, fill_value=0, chunk_key_encoding=CHUNK_KEYS,
                                attributes={"torch_dtype": "t"},
                                config={"write_empty_chunks": True})
    array[...] = a
    here, there = Path(ours.store.root) / "x", Path(theirs.store.root) / "x"
    assert (json.loads((here / "zarr.json").read_text())
            == json.loads((there / "zarr.json").read_text()))
    back = zarr.open_group(ours.store, mode="r")["x"]
    assert np.array_equal(back[...], a) and back.dtype == a.dtype
    files = sorted(p.relative_to(here) for p in here.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(there) for p in there.rglob("*") if p.is_file())
    for rel in files:  # the same bytes, edge chunks padded alike
        assert (here / rel).read_bytes() == (there / rel).read_bytes(), rel


def test_export_command_and_resume_errors(tiny_model_dir, tmp_path, capsys):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    opt = torch.optim.AdamW(model.parameters())
    run = tmp_path / "run"
    save(run / "checkpoints", 2, model, opt, model_path=str(tiny_model_dir))
    assert main(["export", str(run), "-o", str(tmp_path / "hf")]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"].endswith("iter-00002")
    assert (tmp_path / "hf" / "config.json").is_file()
    assert main(["export", str(run), "--iteration", "1", "-o", str(tmp_path / "x")]) == 2
    assert "whole ones: [2]" in capsys.readouterr().err
    # resume: a directory that is not a run, a config file beside --resume
    assert main(["train", "--resume", str(tmp_path / "nope")]) == 2
    assert "no config.json" in capsys.readouterr().err
    (run / "config.json").write_text(json.dumps({"name": "run", "iterations": 2}))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    assert main(["train", "--resume", str(empty)]) == 2
    assert "no whole checkpoint" in capsys.readouterr().err
    assert main(["train", "run.toml", "--resume", str(run)]) == 2
    assert "--resume reads the run's config.json" in capsys.readouterr().err
    assert main(["train", "--resume", str(run), "--set", "name=other"]) == 2
    err = capsys.readouterr().err.strip()
    assert "do not override" in err and "\n" not in err


def test_trim_run_drops_what_came_after_the_checkpoint(tmp_path):
    run = RunDir(tmp_path)
    (tmp_path / "rollouts").mkdir()
    for it in range(4):
        run.append_metrics({"event": "iteration", "iteration": it})
        run.append_metrics({"event": "eval", "iteration": it})
        run.append_jsonl("decisions.jsonl", {"iteration": it, "kind": "scale"})
        (tmp_path / "rollouts" / f"iter-{it:05d}.parquet").write_bytes(b"x")
    run.append_metrics({"event": "data"})
    trim_run(run, 2, drop_eval_at=True)
    kept = [(m["event"], m.get("iteration")) for m in run.metrics()]
    assert kept == [("iteration", 0), ("eval", 0), ("iteration", 1), ("eval", 1),
                    ("iteration", 2), ("data", None)]
    assert [d["iteration"] for d in run.read_jsonl("decisions.jsonl")] == [0, 1, 2]
    assert sorted(p.name for p in (tmp_path / "rollouts").iterdir()) == [
        f"iter-{i:05d}.parquet" for i in range(3)]
