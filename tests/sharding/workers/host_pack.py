"""Worker (8 fake CPU devices) for test_host_pack.py: packs a step's rows (split over the batch axes) and step-global
values (replicated) on a data=2, fsdp=2, tensor=2 mesh, once with the rows divisible by the batch axes and once with
a row count that leaves them replicated, and unpacks them inside a jitted program. Prints one JSON line."""

from __future__ import annotations

import json

import jax
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jrl import sharding as S


def _case(mesh, rules, rows: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    batch = {"ids": rng.integers(-2**31, 2**31 - 1, (rows, 6)),
             "mask": rng.random((rows, 6)) < 0.5,
             "adv": rng.standard_normal(rows).astype(np.float32),
             "half": rng.standard_normal((rows, 3)).astype(ml_dtypes.bfloat16),
             "none": None}
    aux = {"scale": np.float32(rng.standard_normal()), "table": rng.standard_normal((2, 5))}
    tree = (batch, aux)
    shardings = (jax.tree.map(lambda x: S.batch_sharding(mesh, np.ndim(x), rules, shape=np.shape(x)), batch),
                 jax.tree.map(lambda x: NamedSharding(mesh, PartitionSpec()), aux))
    pack = S.HostPack.of(tree, shardings)
    out = jax.jit(lambda p: jax.tree.map(lambda x: x, S.unpack(p)))(pack)
    leaves_ok, shardings_ok = [], []
    for (path, got), want, sharding in zip(jax.tree_util.tree_leaves_with_path(out), jax.tree.leaves(tree),
                                           jax.tree.leaves(shardings), strict=True):
        want = np.asarray(want)
        want = want.astype(jax.dtypes.canonicalize_dtype(want.dtype))
        leaves_ok.append(bool(got.dtype == want.dtype and got.shape == want.shape
                              and np.array_equal(np.asarray(got), want)))
        shardings_ok.append(got.sharding.is_equivalent_to(sharding, want.ndim))
    lowered = jax.jit(S.unpack).lower(pack).as_text()
    split = [list(a) if isinstance(a, tuple) else a for a in shardings[0]["ids"].spec]
    return dict(leaves_ok=leaves_ok, shardings_ok=shardings_ok, none_kept=out[0]["none"] is None,
                pack_leaves=len(jax.tree.leaves(pack)), pack_shards=len(pack.buffer.addressable_shards),
                pack_shape=list(pack.buffer.shape), row_split=split,
                program_inputs=lowered.split("@main(", 1)[1].split(")", 1)[0].count("%arg"))


def main() -> None:
    assert jax.device_count() == 8
    cfg = S.MeshConfig(data=2, fsdp=2, tensor=2)
    mesh, rules = S.make_mesh(cfg), cfg.logical_rules()
    print(json.dumps(dict(split=_case(mesh, rules, rows=8, seed=0), replicated=_case(mesh, rules, rows=3, seed=1))))


if __name__ == "__main__":
    main()
