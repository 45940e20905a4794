"""Torch and scheduler state in zarr v3 groups, without pickle.

What goes where (``group`` is an open ``zarr.Group``):

* a **tensor** is one array whose attribute ``torch_dtype`` names its dtype. ``bfloat16`` is
  stored as its ``uint16`` bit pattern (numpy has no bfloat16), so the round trip is bit-exact
  for every dtype in ``TORCH_DTYPES``; 0-d tensors stay 0-d. Arrays are uncompressed (random
  weights barely compress, and the codec costs more than the bytes saved), chunked along
  dimension 0 in pieces of at most ``CHUNK_BYTES``, a divisor of the rows where one is close,
  so that no padded edge chunk lands on disk. Every chunk is written, zeros included. In a
  local store the metadata and chunk files are written directly, per the zarr v3 spec
  (``put_array``), and read back the same way (``read_local``): zarr's own write and read
  paths run at a fraction of the disk's speed.
* a **plain tree** (a ``state_dict`` of lists, numbers, strings and ``None``, as
  ``LengthPredictor`` and ``ThroughputModel`` give) is a group: dicts become subgroups,
  numeric (possibly nested) lists become arrays, everything else one JSON attribute.
* the **RNG states** of this process: torch (CPU and each CUDA device), numpy's global
  generator and Python's ``random``, as arrays of their words plus attributes.
* a **model**: one array per tensor of its ``state_dict`` (tied tensors once).
* an **optimizer**: for each parameter, by the parameter's name in the model, a group of its
  state tensors (AdamW: ``exp_avg``, ``exp_avg_sq``, ``step``); ``param_groups`` as an
  attribute.

Reading never unpickles: zarr metadata is JSON and chunks are raw little-endian bytes.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
from zarr.storage import LocalStore

from rlhfless.ops.algo.parallel import inner, is_sharded, local_part, shard_rows
from rlhfless.ops.engine.lora import adapter_scale, frozen_names, trainable_names

CHUNK_BYTES = 32 << 20  # largest chunk written
CHUNK_KEYS = {"name": "default", "separator": "."}  # chunk files c.0.0 beside zarr.json
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_NAME_OF = {dtype: name for name, dtype in TORCH_DTYPES.items()}


# ---- arrays and tensors ------------------------------------------------------------------

def chunk_rows(shape: tuple[int, ...], itemsize: int, limit: int = CHUNK_BYTES) -> int:
    """Rows of dimension 0 per chunk: all of them if they fit in ``limit`` bytes, else the
    largest divisor of the row count that fits (if it fills at least half of ``limit``),
    else as many rows as fit."""
    rows = shape[0]
    row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * itemsize)
    fit = max(1, limit // row_bytes)
    if rows <= fit:
        return max(1, rows)
    for d in range(fit, max(1, fit // 2) - 1, -1):
        if rows % d == 0:
            return d
    return fit


def chunk_shape(shape: tuple[int, ...], itemsize: int,
                limit: int = CHUNK_BYTES) -> tuple[int, ...]:
    """Chunks of ``chunk_rows`` rows; every extent at least 1, as zarr requires."""
    if not shape:
        return ()
    return (chunk_rows(shape, itemsize, limit), *(max(1, d) for d in shape[1:]))


def array_metadata(a: np.ndarray, chunks: tuple[int, ...], attributes: Mapping) -> dict:
    """The zarr v3 ``zarr.json`` of an uncompressed little-endian array (the spec's
    ``bytes`` codec alone), exactly as zarr-python writes it for these arguments."""
    fill = False if a.dtype.kind == "b" else 0.0 if a.dtype.kind == "f" else 0
    codec: dict[str, Any] = {"name": "bytes"}
    if a.dtype.itemsize > 1:
        codec["configuration"] = {"endian": "little"}
    return {
        "shape": list(a.shape), "data_type": a.dtype.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
        "fill_value": fill, "codecs": [codec], "attributes": dict(attributes),
        "zarr_format": 3, "node_type": "array", "storage_transformers": [],
    }


def put_array(group: zarr.Group, name: str, a: np.ndarray, attributes: Mapping | None = None,
              limit: int = CHUNK_BYTES) -> None:
    """Store ``a`` as array ``name`` of ``group``: uncompressed, every chunk written.

    In a local store the array is written directly: its ``zarr.json`` (``array_metadata``)
    and each chunk's raw little-endian bytes in its file (``c.<i>.0...``, the last chunk
    padded with zeros), as the zarr v3 spec lays them out; zarr reads it back. That skips
    zarr's codec pipeline, whose copies and thread hand-offs cost more than the disk. The
    ``.`` chunk-key separator keeps every array in one directory: fewer directories to
    create and fsync. Elsewhere zarr writes it, with the same metadata."""
    a = np.asarray(a)
    chunks = chunk_shape(a.shape, a.itemsize, limit)
    attributes = dict(attributes or {})
    store = group.store
    if not isinstance(store, LocalStore) or a.dtype.kind not in "biuf":
        array = group.create_array(name, shape=a.shape, dtype=a.dtype, chunks=chunks,
                                   compressors=None, fill_value=0, attributes=attributes,
                                   chunk_key_encoding=CHUNK_KEYS,
                                   config={"write_empty_chunks": True})
        if a.size:
            array[...] = a
        return
    root = Path(store.root) / group.path / name
    root.mkdir()
    (root / "zarr.json").write_text(json.dumps(array_metadata(a, chunks, attributes), indent=2))
    if a.size == 0:
        return
    data = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).reshape(a.shape)
    for key, piece in chunk_pieces(data, chunks):
        with open(root / key, "wb") as f:
            f.write(memoryview(piece.reshape(-1)).cast("B"))
            if a.ndim and len(piece) < chunks[0]:
                f.write(bytes((chunks[0] - len(piece)) * piece[0].nbytes))


def chunk_pieces(a: np.ndarray, chunks: tuple[int, ...]) -> list[tuple[str, np.ndarray]]:
    """Each chunk file's key (zarr v3's default encoding, chunked along the first axis
    only) and the rows of ``a`` it holds, as views."""
    if a.ndim == 0:
        return [("c", a.reshape(1))]
    rows, tail = chunks[0], ".0" * (a.ndim - 1)
    return [(f"c.{i // rows}{tail}", a[i:i + rows]) for i in range(0, len(a), rows)]


def get_array(array: zarr.Array) -> np.ndarray:
    """The whole array as a writable numpy array (0-d stays 0-d). One that ``put_array``
    wrote into a local store is read straight from its chunk files into the array
    (``read_local``); any other goes through zarr."""
    a = read_local(array)
    if a is None:
        a = np.asarray(array[...])
    return a if a.flags.writeable else a.copy()


def read_local(array: zarr.Array) -> np.ndarray | None:
    """``array`` read chunk by chunk into one numpy array, each chunk's file straight into
    its rows, where it is laid out as ``put_array`` writes it in a local store (its
    ``zarr.json`` that of ``array_metadata``, every chunk file there); else None. zarr's own
    read, through its codec pipeline and its event loop's thread, restored a 0.5B trainer's
    checkpoint at 0.06x the file read rate (docs/benchmarks.md#weights)."""
    if not isinstance(array.store, LocalStore) or sys.byteorder != "little":
        return None
    root = Path(array.store.root) / array.path
    meta = json.loads((root / "zarr.json").read_text())
    shape = tuple(meta["shape"])
    a = np.empty(shape, dtype=np.dtype(meta["data_type"]))
    chunks = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
    if meta != array_metadata(a, chunks, meta["attributes"]) or chunks[1:] != shape[1:]:
        return None
    for key, piece in chunk_pieces(a, chunks):
        view = memoryview(piece.reshape(-1)).cast("B")
        try:
            with open(root / key, "rb", buffering=0) as f:
                got = f.readinto(view)
        except FileNotFoundError:  # a chunk zarr left out (its fill value): zarr reads it
            return None
        if got != len(view):
            raise ValueError(f"array {array.path!r}: chunk {key} holds {got} bytes, its rows "
                             f"need {len(view)}")
    return a


def put_tensor(group: zarr.Group, name: str, tensor: torch.Tensor) -> None:
    t = tensor.detach().cpu().contiguous()
    dtype = _NAME_OF.get(t.dtype)
    if dtype is None:
        raise ValueError(f"tensor {name!r} has dtype {t.dtype}; a checkpoint stores "
                         f"{sorted(TORCH_DTYPES)}")
    a = t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    put_array(group, name, a, {"torch_dtype": dtype})


def get_tensor(array: zarr.Array) -> torch.Tensor:
    dtype = array.attrs.get("torch_dtype")
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"array {array.path!r}: torch_dtype {dtype!r} is not one of "
                         f"{sorted(TORCH_DTYPES)}")
    a = get_array(array)
    want = np.uint16 if dtype == "bfloat16" else torch.empty(0, dtype=TORCH_DTYPES[dtype]
                                                             ).numpy().dtype
    if a.dtype != want:
        raise ValueError(f"array {array.path!r}: stored as {a.dtype}, expected {want} for "
                         f"torch_dtype {dtype}")
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def put_tensors(group: zarr.Group, tensors: Mapping[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        put_tensor(group, name, tensor)


def get_tensors(group: zarr.Group) -> dict[str, torch.Tensor]:
    return {name: get_tensor(array) for name, array in group.arrays()}


# ---- plain trees -------------------------------------------------------------------------

def _numeric(value: Any) -> np.ndarray | None:
    if isinstance(value, np.ndarray):
        return value if value.dtype.kind in "biuf" else None
    if not isinstance(value, list | tuple):
        return None
    try:
        a = np.asarray(value)
    except ValueError:  # ragged
        return None
    return a if a.dtype.kind in "biuf" else None


def put_tree(group: zarr.Group, tree: Mapping[str, Any]) -> None:
    """Store a plain tree: dicts as subgroups, numeric lists as arrays, the rest as JSON."""
    attrs = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            put_tree(group.create_group(str(key)), value)
        elif (a := _numeric(value)) is not None:
            put_array(group, str(key), a, {"as": "ndarray" if isinstance(value, np.ndarray)
                                           else "list"})
        else:
            attrs[str(key)] = value
    group.attrs.update(attrs)


def get_tree(group: zarr.Group) -> dict[str, Any]:
    """The tree ``put_tree`` stored: lists come back as lists, ndarrays as ndarrays."""
    tree: dict[str, Any] = dict(group.attrs)
    for name, array in group.arrays():
        a = get_array(array)
        tree[name] = a if array.attrs.get("as") == "ndarray" else a.tolist()
    for name, sub in group.groups():
        tree[name] = get_tree(sub)
    return tree


# ---- RNG states --------------------------------------------------------------------------

def put_rng(group: zarr.Group) -> None:
    """The RNG states of this process: torch CPU (+ CUDA devices), numpy global, python."""
    put_tensor(group, "torch", torch.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    for i, state in enumerate(cuda):
        put_tensor(group, f"cuda_{i}", state)
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    put_array(group, "numpy_keys", np.asarray(keys, dtype=np.uint32))
    version, words, gauss_next = random.getstate()
    put_array(group, "python_words", np.asarray(words, dtype=np.uint32))
    group.attrs.update({
        "cuda_devices": len(cuda),
        "numpy": {"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "python": {"version": int(version), "gauss_next": gauss_next},
    })


def set_rng(group: zarr.Group) -> None:
    """Restore the states ``put_rng`` stored into this process's generators."""
    torch.set_rng_state(get_tensor(group["torch"]))
    n_cuda = int(group.attrs.get("cuda_devices", 0))
    if n_cuda:
        if not torch.cuda.is_available() or torch.cuda.device_count() < n_cuda:
            raise RuntimeError(f"RNG state {group.path!r} holds {n_cuda} CUDA generators; "
                               f"this process sees {torch.cuda.device_count()} devices")
        torch.cuda.set_rng_state_all([get_tensor(group[f"cuda_{i}"]) for i in range(n_cuda)])
    npy = group.attrs["numpy"]
    np.random.set_state((npy["kind"], get_array(group["numpy_keys"]), npy["pos"],
                         npy["has_gauss"], npy["cached_gaussian"]))
    py = group.attrs["python"]
    words = tuple(int(w) for w in get_array(group["python_words"]))
    random.setstate((py["version"], words, py["gauss_next"]))


# ---- models and optimizers ---------------------------------------------------------------

def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's ``state_dict`` with each shared (tied) tensor once, first name wins;
    with frozen parameters (LoRA) only the ones that train."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    keep = trainable_names(model)
    for name, tensor in model.state_dict().items():
        if keep is not None and name not in keep:
            continue
        ident = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
                 tuple(tensor.shape), tensor.dtype)
        if ident not in seen:
            seen.add(ident)
            out[name] = tensor
    return out


def load_model_tensors(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor],
                       where: str) -> None:
    """Copy ``tensors`` into ``model``; only tied and frozen tensors may be missing, none
    unexpected."""
    missing, unexpected = model.load_state_dict(dict(tensors), strict=False)
    tied = set(model.state_dict()) - set(model_tensors(model)) | frozen_names(model)
    if unexpected or set(missing) - tied:
        raise ValueError(f"{where}: missing {sorted(set(missing) - tied)}, "
                         f"unexpected {sorted(unexpected)}")


def _optimizer_param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                           ) -> list[str]:
    """Names of the optimizer's parameters in ``state_dict`` index order."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    unknown = [i for i, p in enumerate(params) if id(p) not in name_of]
    if unknown:
        raise ValueError(f"optimizer parameters {unknown} are not parameters of the model")
    return [name_of[id(p)] for p in params]


def put_optimizer(group: zarr.Group, model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer) -> None:
    names = _optimizer_param_names(model, optimizer)
    sd = optimizer.state_dict()
    group.attrs["param_groups"] = [{k: list(v) if isinstance(v, tuple) else v
                                    for k, v in g.items()} for g in sd["param_groups"]]
    group.attrs["class"] = type(optimizer).__name__
    for index, state in sd["state"].items():
        sub = group.create_group(names[index])
        scalars = {}
        for key, value in state.items():
            if torch.is_tensor(value):
                put_tensor(sub, key, value)
            else:
                scalars[key] = value
        sub.attrs["scalars"] = scalars


def load_optimizer(group: zarr.Group, model: torch.nn.Module,
                   optimizer: torch.optim.Optimizer) -> None:
    """Restore what ``put_optimizer`` stored into ``optimizer`` (same class, same params)."""
    stored = group.attrs.get("class")
    if stored != type(optimizer).__name__:
        raise ValueError(f"optimizer state {group.path!r} is of {stored}, the trainer's "
                         f"optimizer is {type(optimizer).__name__}")
    names = _optimizer_param_names(model, optimizer)
    index = {name: i for i, name in enumerate(names)}
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()}
              for g in group.attrs["param_groups"]]
    state: dict[int, dict[str, Any]] = {}
    for name, sub in group.groups():
        if name not in index:
            raise ValueError(f"optimizer state {group.path!r} has parameter {name!r}, "
                             "which the model does not have")
        state[index[name]] = {k: get_tensor(a) for k, a in sub.arrays()} | dict(
            sub.attrs.get("scalars", {}))
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ---- sharded trainers: every rank writes and reads its own rows --------------------------
#
# The layout is the one above (one array of the whole shape per tensor), so a checkpoint
# written by N ranks is read by M ranks, or by one, and the other way round. A tensor
# sharded on dimension 0 (an FSDP2 DTensor) is written by each rank as the chunks of its rows
# (chunks of a divisor of the rows per rank, so no two ranks write one chunk file); a
# replicated tensor (DDP) likewise, each rank its ``shard_rows``; 0-d tensors, metadata and
# the RNG by rank 0. Files only, no zarr calls: ranks write concurrently into one store.

def _group_json(path: Path, attributes: Mapping | None = None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    meta = {"zarr_format": 3, "node_type": "group", "attributes": dict(attributes or {})}
    (path / "zarr.json").write_text(json.dumps(meta))


def _numpy_of(t: torch.Tensor, where: str) -> tuple[np.ndarray, str]:
    t = t.detach().cpu().contiguous()
    name = _NAME_OF.get(t.dtype)
    if name is None:
        raise ValueError(f"tensor {where!r} has dtype {t.dtype}; a checkpoint stores "
                         f"{sorted(TORCH_DTYPES)}")
    return (t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()), name


def put_tensor_rows(path: Path, tensor: torch.Tensor, rank: int, world: int) -> int:
    """Write this rank's rows of ``tensor`` (a dimension-0 DTensor shard, or a replicated
    tensor) as array ``path``; returns the bytes written."""
    shape = tuple(tensor.shape)
    if not shape:
        if rank != 0:
            return 0
        a, dtype = _numpy_of(local_part(tensor), str(path))
        start, per = 0, 1
    else:
        start, stop = shard_rows(shape[0], rank, world)
        local = local_part(tensor) if is_sharded(tensor) else tensor[start:stop]
        if local.shape[0] != stop - start:
            raise ValueError(f"{path}: rank {rank} holds {local.shape[0]} rows, expected "
                             f"{stop - start} (not a dimension-0 shard)")
        a, dtype = _numpy_of(local, str(path))
        per = shard_rows(shape[0], 0, world)[1] or 1
    row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * a.itemsize)
    rows = next(d for d in range(per, 0, -1) if per % d == 0 and d * row_bytes <= CHUNK_BYTES
                or d == 1)
    chunks = (rows, *(max(1, d) for d in shape[1:])) if shape else ()
    path.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        whole = np.broadcast_to(np.zeros((), a.dtype), shape)  # shape and dtype, no bytes
        (path / "zarr.json").write_text(json.dumps(
            array_metadata(whole, chunks, {"torch_dtype": dtype}), indent=2))
    data = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
    if not shape:
        (path / "c").write_bytes(memoryview(data.reshape(1)).cast("B"))
        return data.nbytes
    tail = ".0" * (len(shape) - 1)
    for i in range(0, len(data), rows):
        piece = data[i:i + rows]
        with open(path / f"c.{(start + i) // rows}{tail}", "wb") as f:
            f.write(memoryview(piece.reshape(-1)).cast("B"))
            if len(piece) < rows:
                f.write(bytes((rows - len(piece)) * piece[0].nbytes))
    return data.nbytes


def get_tensor_rows(array: zarr.Array, like: torch.Tensor, rank: int, world: int
                    ) -> torch.Tensor:
    """What this rank holds of ``array`` for a tensor shaped as ``like``: its rows if
    ``like`` is a dimension-0 DTensor shard, else the whole array."""
    if tuple(array.shape) != tuple(like.shape):
        raise ValueError(f"array {array.path!r} has shape {tuple(array.shape)}, the trainer's "
                         f"tensor {tuple(like.shape)}")
    if not is_sharded(like) or not like.shape:
        return get_tensor(array)
    start, stop = shard_rows(like.shape[0], rank, world)
    dtype = array.attrs.get("torch_dtype")
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"array {array.path!r}: torch_dtype {dtype!r} is not one of "
                         f"{sorted(TORCH_DTYPES)}")
    t = torch.from_numpy(np.array(array[start:stop]))
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def _copy_rows(target: torch.Tensor, rows: torch.Tensor) -> None:
    with torch.no_grad():
        local_part(target).copy_(rows.view(local_part(target).shape))


def put_trainer_rows(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     rank: int, world: int) -> int:
    """This rank's part of ``trainer/`` (model, optimizer; rank 0 also the metadata and its
    RNG) under the checkpoint directory ``path``; returns the bytes of tensors written."""
    module = inner(model)
    trainer = path / "trainer"
    sd = optimizer.state_dict()
    names = _optimizer_param_names(module, optimizer)
    if rank == 0:
        _group_json(trainer, {"ranks": world, "lora_scale": adapter_scale(module)})
        _group_json(trainer / "model")
        _group_json(trainer / "optimizer", {
            "param_groups": [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()}
                             for g in sd["param_groups"]],
            "class": type(optimizer).__name__})
        put_rng(zarr.open_group(trainer / "rng", mode="w", zarr_format=3))
    n, seen, keep = 0, set(), trainable_names(module)
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) not in seen and (keep is None or name in keep):  # as model_tensors
            seen.add(id(t))
            n += put_tensor_rows(trainer / "model" / name, t, rank, world)
    for index, state in sd["state"].items():
        sub = trainer / "optimizer" / names[index]
        if rank == 0:
            _group_json(sub, {"scalars": {k: v for k, v in state.items()
                                          if not torch.is_tensor(v)}})
        for key, value in state.items():
            if torch.is_tensor(value):
                n += put_tensor_rows(sub / key, value, rank, world)
    return n


def load_trainer_rows(group: zarr.Group, model: torch.nn.Module,
                      optimizer: torch.optim.Optimizer, rank: int, world: int,
                      where: str) -> None:
    """Restore a ``trainer/`` group written by any number of ranks into this rank."""
    module = inner(model)
    stored = dict(group["model"].arrays())
    targets = module.state_dict(keep_vars=True)
    aliases: dict[int, list[str]] = {}  # tied tensors: one array under any of their names
    for name, t in targets.items():
        aliases.setdefault(id(t), []).append(name)
    found = {i: next((n for n in names if n in stored), None) for i, names in aliases.items()}
    frozen = frozen_names(module)
    missing = sorted(names[0] for i, names in aliases.items()
                     if found[i] is None and not frozen & set(names))
    unexpected = sorted(set(stored) - set(targets))
    if missing or unexpected:
        raise ValueError(f"{where}: missing {missing}, unexpected {unexpected}")
    for i, name in found.items():
        if name is None:  # frozen: the model directory's
            continue
        t = targets[aliases[i][0]]
        _copy_rows(t, get_tensor_rows(stored[name], t, rank, world))
    opt = group["optimizer"]
    if opt.attrs.get("class") != type(optimizer).__name__:
        raise ValueError(f"optimizer state {opt.path!r} is of {opt.attrs.get('class')}, the "
                         f"trainer's optimizer is {type(optimizer).__name__}")
    names = _optimizer_param_names(module, optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    index = {name: i for i, name in enumerate(names)}
    state: dict[int, dict[str, Any]] = {}
    for name, sub in opt.groups():
        if name not in index:
            raise ValueError(f"optimizer state {opt.path!r} has parameter {name!r}, which "
                             "the model does not have")
        p = params[index[name]]
        state[index[name]] = dict(sub.attrs.get("scalars", {}))
        for key, array in sub.arrays():
            if is_sharded(p) and tuple(array.shape) == tuple(p.shape) and array.shape:
                value = torch.zeros_like(p, dtype=TORCH_DTYPES[array.attrs["torch_dtype"]])
                _copy_rows(value, get_tensor_rows(array, p, rank, world))
            else:  # replicated, or a 0-d step
                value = get_tensor(array)
            state[index[name]][key] = value
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()}
              for g in opt.attrs["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    set_rng(group["rng"])
