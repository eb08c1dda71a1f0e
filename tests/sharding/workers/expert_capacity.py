"""Worker (8 fake CPU devices): the expert-parallel MoE block with a capacity (``ModelConfig.expert_capacity``)
against one device, float32, forward and every gradient (tokens, routing weights, expert weights): routing spread
over the devices (every device's rows fit the buffer: the same as one device), routing that sends two thirds of the
rows to the first device's experts (they do not fit: the same as one device without the rows the buffer drops, the
device's last rows in expert order), and no capacity (dropless: the same as one device). Records the row counts the
test checks the cases against and whether the capped program holds a buffer of that many rows. Prints one JSON
line."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from jrl import sharding as S
from jrl.kernels.moe import gmm, swiglu
from jrl.models.expert_parallel import capacity_rows, moe_expert_parallel, routed

E, K, H, I = 8, 3, 16, 12
BATCH, SEQ = 8, 16  # 128 tokens, 16 per device on expert=4 x fsdp=2
AXES = (("expert", "embed", "expert_mlp"), ("expert", "embed", "expert_mlp"), ("expert", "expert_mlp", "embed"))


def experts(rows, group_sizes, gate, up, down, rows_in_use=None):
    return gmm(swiglu(gmm(rows, gate, group_sizes), gmm(rows, up, group_sizes), rows_in_use), down, group_sizes)


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


def kept(ids: np.ndarray, groups: int, ep: int, rows: int | None) -> np.ndarray:
    """[B, S, K] 1.0 where a (token, expert) row runs, 0.0 where a device's buffer of ``rows`` drops it: the tokens
    split into ``groups`` contiguous groups (those one device's expert axis gathers), each device keeping the first
    ``rows`` of its experts' rows in (expert, token, k) order."""
    keep = np.ones(ids.size, np.float32)
    if rows is None:
        return keep.reshape(ids.shape)
    local = E // ep
    for g, group in enumerate(np.split(ids.reshape(-1), groups)):
        base = g * group.size
        for d in range(ep):
            mine = np.flatnonzero(group // local == d)
            order = mine[np.argsort(group[mine], kind="stable")]
            keep[base + order[rows:]] = 0.0
    return keep.reshape(ids.shape)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def block_dropped(mesh, rules) -> dict:
    """``moe/dropped_rows`` of a Qwen3-MoE block on the mesh whose router sends every token to experts 0..K-1 (a zero
    router: equal logits, ties to the lowest ids), with and without a capacity of 2."""
    from flax import nnx

    from jrl.models import ModelConfig, router_stats
    from jrl.models.moe import MoE

    shares = {}
    for capacity in (2.0, 0.0):
        config = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=H, intermediate_size=32,
                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                             qk_norm=True, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=I,
                             dtype="float32", param_dtype="float32", expert_capacity=capacity)
        block = S.shard_model(MoE(config, rngs=nnx.Rngs(0), mesh=mesh, rules=rules), mesh, rules)
        block.router.kernel[...] = jnp.zeros_like(block.router.kernel[...])

        @nnx.jit
        def run(block, x):
            with router_stats.collecting() as stats:
                block(x)
            return router_stats.summary(stats)["moe/dropped_rows"]

        shares[str(capacity)] = float(run(block, jax.random.normal(jax.random.key(2), (BATCH, SEQ, H))))
    return shares


def main() -> None:
    cfg = S.MeshConfig(expert=4, fsdp=2)
    mesh, rules = S.make_mesh(cfg), cfg.logical_rules()
    ep = mesh.shape["expert"]

    def loss(block, x, weights, ids, params):
        y = block(x, weights, ids, params)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape)))

    def one_device(x, weights, ids, params):
        return routed(x, weights, ids, E, lambda rows, counts: experts(rows, counts, *params))

    def parallel(capacity, chunks=1):
        return lambda x, weights, ids, params: moe_expert_parallel(
            x, weights, ids, experts, params, AXES, num_experts=E, mesh=mesh, rules=rules, axis="expert",
            capacity=capacity, chunks=chunks)[0]

    grad = lambda block: jax.jit(jax.value_and_grad(lambda *a: loss(block, *a), argnums=(0, 1, 3)))
    # The expert axis gathers the tokens of 4 devices (2 fsdp groups of them): 64 tokens x K row slots per device.
    slots = BATCH * SEQ // mesh.shape["fsdp"] * K
    out = {"slots": slots, "rows": capacity_rows(2.0, slots, ep), "cases": {}}
    for routing in ("spread", "skewed"):
        x, weights, ids, params = inputs(routing == "skewed")
        ids_np = np.asarray(ids).reshape(mesh.shape["fsdp"], -1, K)  # fsdp group -> its 64 tokens' experts
        out.setdefault("max_device_rows", {})[routing] = int(max(
            ((ids_np[g] // (E // ep)) == d).sum() for g in range(mesh.shape["fsdp"]) for d in range(ep)))
        for capacity in (2.0, 0.0):
            keep = jnp.asarray(kept(np.asarray(ids), mesh.shape["fsdp"], ep, capacity_rows(capacity, slots, ep)))
            def dropped(x, weights, ids, params, keep=keep):  # one device, the rows the buffer drops weighted zero
                return one_device(x, weights * keep, ids, params)
            ref_value, ref_grads = grad(dropped)(x, weights, ids, params)
            ref = dropped(x, weights, ids, params)
            out.setdefault("dropped", {})[f"{routing}/{capacity}"] = int((np.asarray(keep) == 0).sum())
            share = jax.jit(lambda x, weights, ids, params, capacity=capacity: moe_expert_parallel(
                x, weights, ids, experts, params, AXES, num_experts=E, mesh=mesh, rules=rules, axis="expert",
                capacity=capacity)[1])(x, weights, ids, params)
            out.setdefault("dropped_share", {})[f"{routing}/{capacity}"] = float(share)
            block = parallel(capacity)
            value, grads = grad(block)(x, weights, ids, params)
            errs = dict(y=rel(jax.jit(block)(x, weights, ids, params), ref), loss=rel(value, ref_value),
                        dx=rel(grads[0], ref_grads[0]), dweights=rel(grads[1], ref_grads[1]),
                        dparams=max(rel(a, b) for a, b in zip(grads[2], ref_grads[2])))
            errs["finite"] = bool(np.isfinite(list(errs.values())).all())
            out["cases"][f"{routing}/{capacity}"] = errs
        # Dropless in 4 chunks of a device's 16 tokens: the same as one device.
        ref_value, ref_grads = grad(one_device)(x, weights, ids, params)
        value, grads = grad(parallel(0.0, chunks=4))(x, weights, ids, params)
        errs = dict(y=rel(jax.jit(parallel(0.0, chunks=4))(x, weights, ids, params), one_device(x, weights, ids,
                                                                                               params)),
                    loss=rel(value, ref_value), dx=rel(grads[0], ref_grads[0]), dweights=rel(grads[1], ref_grads[1]),
                    dparams=max(rel(a, b) for a, b in zip(grads[2], ref_grads[2])))
        errs["finite"] = bool(np.isfinite(list(errs.values())).all())
        out["cases"][f"{routing}/chunks4"] = errs
    out["block_dropped"] = block_dropped(mesh, rules)
    try:
        parallel(0.0, chunks=3)(*inputs(False))
    except ValueError as e:
        out["chunks_error"] = str(e)
    x, weights, ids, params = inputs(False)
    for capacity in (2.0, 0.0):
        text = str(jax.make_jaxpr(jax.grad(lambda *a: loss(parallel(capacity), *a)))(x, weights, ids, params))
        out.setdefault("capped_buffer", {})[str(capacity)] = f"f32[{out['rows']},{H}]" in text
    print(json.dumps(out))


if __name__ == "__main__":
    main()
