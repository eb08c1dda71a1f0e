"""Child process for test_model_mesh.py: runs on 8 fake CPU devices (XLA_FLAGS set by the parent).

argv: CHECKPOINT_DIR OUT_DIR INPUTS_NPZ (ids, reference logits). Prints one JSON line with what the parent asserts.
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jrl.models import create_model, from_pretrained, named_params, save_pretrained


def spec(var):
    """The PartitionSpec as a JSON list, padded to the array's rank."""
    s = list(var[...].sharding.spec)
    return s + [None] * (var[...].ndim - len(s))


def main(src, out, inputs):
    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(1, 2, 2, 2), ("data", "fsdp", "tensor", "expert"))
    sharded = from_pretrained(src, dtype=jnp.float32, mesh=mesh)
    params = named_params(sharded)
    specs = {k: spec(v) for k, v in params.items()}
    shard_shapes = {k: list(v[...].addressable_shards[0].data.shape) for k, v in params.items()}
    data = np.load(inputs)
    logits = np.asarray(nnx.jit(lambda m, x: m(x))(sharded, jnp.asarray(data["ids"])))
    save_pretrained(sharded, out)
    random = create_model(sharded.config, seed=1, mesh=mesh)
    random_specs = {k: spec(v) for k, v in named_params(random).items()}
    print(json.dumps(dict(specs=specs, shard_shapes=shard_shapes, max_diff=float(np.abs(logits - data["logits"]).max()),
                          random_specs=random_specs,
                          random_std=float(np.std(np.asarray(random.layers[0].attn.q_proj.kernel[...]))))))


if __name__ == "__main__":
    main(*sys.argv[1:4])
