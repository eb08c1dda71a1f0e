"""Child process for test_model_mesh.py: runs on 8 fake CPU devices (XLA_FLAGS set by the parent).

argv: CHECKPOINT_DIR OUT_DIR. Prints one JSON line with what the parent asserts.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jrl.models import create_model, from_pretrained, named_params, save_pretrained


def main(src, out):
    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(1, 2, 2, 2), ("data", "fsdp", "tensor", "expert"))
    sharded = from_pretrained(src, dtype=jnp.float32, mesh=mesh)
    plain = from_pretrained(src, dtype=jnp.float32)
    params = named_params(sharded)
    specs = {k: str(v[...].sharding.spec) for k, v in params.items()}
    shard_shapes = {k: list(v[...].addressable_shards[0].data.shape) for k, v in params.items()}
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 16)), jnp.int32)
    fwd = nnx.jit(lambda m, x: m(x))
    a, b = np.asarray(fwd(sharded, ids)), np.asarray(fwd(plain, ids))
    save_pretrained(sharded, out)
    random = create_model(sharded.config, seed=1, mesh=mesh)
    random_specs = {k: str(v[...].sharding.spec) for k, v in named_params(random).items()}
    print(json.dumps(dict(specs=specs, shard_shapes=shard_shapes, max_diff=float(np.abs(a - b).max()),
                          random_specs=random_specs, random_logits_finite=bool(np.isfinite(np.asarray(
                              fwd(random, ids))).all()))))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
