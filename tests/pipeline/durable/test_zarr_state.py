"""Arrays ``put_array`` wrote into a local store are read straight from their chunk files
(``read_local``): the same values zarr's own read gives, padded last chunk, 0-d, empty,
bool and bfloat16 alike; an array zarr laid out otherwise (compressed) is left to zarr."""

from __future__ import annotations

import numpy as np
import torch
import zarr

from rlhfless.pipeline.durable.zarr_state import (
    get_array,
    get_tensor,
    put_array,
    put_tensor,
    read_local,
)

ARRAYS = {
    "padded": np.arange(11 * 3, dtype=np.float32).reshape(11, 3),  # chunks of 4 rows: 4, 4, 3
    "scalar": np.array(2.5),
    "empty": np.zeros((0, 4), dtype=np.int64),
    "flags": np.array([True, False, True]),
    "ints": np.arange(-5, 5, dtype=np.int64).reshape(2, 5),
}


def test_local_arrays_are_read_from_their_chunk_files(tmp_path):
    group = zarr.open_group(tmp_path / "g", mode="w", zarr_format=3)
    for name, a in ARRAYS.items():
        put_array(group, name, a, limit=4 * 3 * 4)
    bf16 = torch.linspace(-1, 1, 10, dtype=torch.bfloat16).reshape(5, 2)
    put_tensor(group, "bf16", bf16)
    for name, a in ARRAYS.items():
        direct = read_local(group[name])
        assert direct is not None and direct.shape == a.shape and direct.dtype == a.dtype
        np.testing.assert_array_equal(direct, a)
        np.testing.assert_array_equal(direct, np.asarray(group[name][...]))  # zarr agrees
    chunk_files = sorted((tmp_path / "g" / "padded").glob("c.*"))
    assert [f.stat().st_size for f in chunk_files] == [4 * 3 * 4] * 3  # the last one padded
    assert read_local(group["bf16"]) is not None
    assert torch.equal(get_tensor(group["bf16"]), bf16)


def test_an_array_zarr_compressed_is_read_by_zarr(tmp_path):
    group = zarr.open_group(tmp_path / "g", mode="w", zarr_format=3)
    a = np.arange(12, dtype=np.float32).reshape(4, 3)
    group.create_array("z", shape=a.shape, dtype=a.dtype, chunks=(2, 3))[...] = a
    assert read_local(group["z"]) is None
    np.testing.assert_array_equal(get_array(group["z"]), a)
