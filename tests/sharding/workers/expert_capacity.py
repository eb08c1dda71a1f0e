"""Worker (8 fake CPU devices): the expert-parallel MoE block with its static row buffer
(``ModelConfig.expert_capacity``) against one device, float32, forward and every gradient (tokens, routing weights,
expert weights): routing spread over the devices (every device's rows fit the buffer), routing that sends every row
to the first device's experts (it does not fit: the exact path through every row slot), and the buffer turned off.
Records the row counts the test checks the cases against and whether the capped program holds a buffer of that many
rows. Prints one JSON line."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from jrl import sharding as S
from jrl.kernels.moe import gmm
from jrl.models.expert_parallel import capacity_rows, moe_expert_parallel, routed

E, K, H, I = 8, 3, 16, 12
BATCH, SEQ = 8, 16  # 128 tokens, 16 per device on expert=4 x fsdp=2
AXES = (("expert", "embed", "expert_mlp"), ("expert", "embed", "expert_mlp"), ("expert", "expert_mlp", "embed"))


def experts(rows, group_sizes, gate, up, down):
    return gmm(jax.nn.silu(gmm(rows, gate, group_sizes)) * gmm(rows, up, group_sizes), down, group_sizes)


def inputs(skewed: bool):
    keys = jax.random.split(jax.random.key(0), 6)
    x = jax.random.normal(keys[0], (BATCH, SEQ, H), jnp.float32)
    params = (0.3 * jax.random.normal(keys[1], (E, H, I)), 0.3 * jax.random.normal(keys[2], (E, H, I)),
              0.3 * jax.random.normal(keys[3], (E, I, H)))
    if skewed:  # every token to experts 0, 1 and 2: two thirds of the rows to the first device (2 experts each)
        ids = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (BATCH, SEQ, K))
    else:  # each token to K distinct random experts
        ids = jnp.argsort(jax.random.uniform(keys[4], (BATCH, SEQ, E)), axis=-1)[..., :K].astype(jnp.int32)
    weights = jax.nn.softmax(jax.random.normal(keys[5], (BATCH, SEQ, K)), axis=-1)
    return x, weights, ids, params


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def main() -> None:
    cfg = S.MeshConfig(expert=4, fsdp=2)
    mesh, rules = S.make_mesh(cfg), cfg.logical_rules()
    ep = mesh.shape["expert"]

    def loss(block, x, weights, ids, params):
        y = block(x, weights, ids, params)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape)))

    def one_device(x, weights, ids, params):
        return routed(x, weights, ids, E, lambda rows, counts: experts(rows, counts, *params))

    def parallel(capacity):
        return lambda x, weights, ids, params: moe_expert_parallel(
            x, weights, ids, experts, params, AXES, num_experts=E, mesh=mesh, rules=rules, axis="expert",
            capacity=capacity)

    grad = lambda block: jax.jit(jax.value_and_grad(lambda *a: loss(block, *a), argnums=(0, 1, 3)))
    # The expert axis gathers the tokens of 4 devices (2 fsdp groups of them): 64 tokens x K row slots per device.
    slots = BATCH * SEQ // mesh.shape["fsdp"] * K
    out = {"slots": slots, "rows": capacity_rows(2.0, slots, ep), "cases": {}}
    for routing in ("spread", "skewed"):
        x, weights, ids, params = inputs(routing == "skewed")
        ids_np = np.asarray(ids).reshape(mesh.shape["fsdp"], -1, K)  # fsdp group -> its 64 tokens' experts
        out.setdefault("max_device_rows", {})[routing] = int(max(
            ((ids_np[g] // (E // ep)) == d).sum() for g in range(mesh.shape["fsdp"]) for d in range(ep)))
        ref_value, ref_grads = grad(one_device)(x, weights, ids, params)
        ref = one_device(x, weights, ids, params)
        for capacity in (2.0, 0.0):
            block = parallel(capacity)
            value, grads = grad(block)(x, weights, ids, params)
            errs = dict(y=rel(jax.jit(block)(x, weights, ids, params), ref), loss=rel(value, ref_value),
                        dx=rel(grads[0], ref_grads[0]), dweights=rel(grads[1], ref_grads[1]),
                        dparams=max(rel(a, b) for a, b in zip(grads[2], ref_grads[2])))
            errs["finite"] = bool(np.isfinite(list(errs.values())).all())
            out["cases"][f"{routing}/{capacity}"] = errs
    x, weights, ids, params = inputs(False)
    for capacity in (2.0, 0.0):
        text = str(jax.make_jaxpr(jax.grad(lambda *a: loss(parallel(capacity), *a)))(x, weights, ids, params))
        out.setdefault("capped_buffer", {})[str(capacity)] = f"f32[{out['rows']},{H}]" in text
        out.setdefault("cond", {})[str(capacity)] = "cond[" in text
    print(json.dumps(out))


if __name__ == "__main__":
    main()
