"""HostPack: a pytree of host arrays as one byte buffer gives back the same arrays (values, dtypes as a jitted
call would canonicalise them, shapes, None leaves), on the host and inside a jitted program, which then takes one
input buffer; on a mesh (8 fake CPU devices in a child process) one buffer row per device, unpacked into arrays with
the shardings they were packed with."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jrl.sharding import HostPack, unpack


def _tree(rng):
    return {
        "ids": rng.integers(-2**31, 2**31 - 1, (3, 5)),  # int64 on the host: int32 in a program
        "mask": rng.random((3, 5)) < 0.5,
        "adv": rng.standard_normal(3).astype(np.float32),
        "half": rng.standard_normal((2, 2)).astype(ml_dtypes.bfloat16),
        "bytes": rng.integers(0, 255, (4,), dtype=np.uint8),
        "scalar": np.float64(rng.standard_normal()),
        "empty": np.zeros((0, 3), np.float32),
        "none": None,
        "rows": (rng.standard_normal((2, 3)).astype(np.float32)[:, ::2],),  # a strided view
    }


def _check(got, tree):
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(tree), strict=True):
        want = np.asarray(w).astype(jax.dtypes.canonicalize_dtype(np.asarray(w).dtype))
        assert g.dtype == want.dtype and g.shape == want.shape, path
        np.testing.assert_array_equal(np.asarray(g), want, err_msg=str(path))
    assert got["none"] is None


def test_round_trip_on_the_host_and_in_a_program():
    rng = np.random.default_rng(0)
    tree = _tree(rng)
    pack = HostPack.of(tree)
    assert len(jax.tree.leaves(pack)) == 1 and pack.buffer.dtype == np.uint8
    _check(pack.unpack(), tree)
    _check(jax.jit(unpack)(pack), tree)
    _check(jax.jit(lambda p: jax.tree.map(lambda x: x, unpack(p)))(HostPack.of(tree)), tree)


def test_unpack_passes_other_trees_through():
    tree = {"a": jnp.ones(2)}
    assert unpack(tree) is tree


@pytest.fixture(scope="module")
def on_mesh(helpers):
    return helpers.run_worker("host_pack.py", num_devices=8)


@pytest.mark.parametrize("case", ["split", "replicated"])
def test_on_a_mesh_one_buffer_row_per_device_gives_back_the_arrays_with_their_shardings(on_mesh, case):
    r = on_mesh[case]
    assert all(r["leaves_ok"]) and len(r["leaves_ok"]) == 6 and r["none_kept"]
    assert all(r["shardings_ok"])
    assert r["pack_leaves"] == 1 and r["pack_shards"] == 8 and r["pack_shape"][0] == 8
    assert r["program_inputs"] == 1
    # 8 rows split over data x fsdp; 3 rows do not divide them and stay whole on every device.
    assert r["row_split"][0] == (["data", "fsdp"] if case == "split" else None)
