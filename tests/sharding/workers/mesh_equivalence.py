"""Worker (8 fake CPU devices): logits, loss and gradients of tiny dense and MoE models on several
meshes vs. the unsharded single-device result; placements vs. the rules; measured vs. predicted
per-device memory; optimizer-state shardings. Prints one JSON line."""

from __future__ import annotations

import functools
import json
import math
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import common
from jrl import sharding as S

MESHES = {
    "single": dict(fsdp=1),
    "fsdp8": dict(fsdp=8),
    "data2_fsdp2_tensor2": dict(data=2, fsdp=2, tensor=2),
    "expert4_fsdp2": dict(expert=4, fsdp=2),
    "expert2_fsdp2_tensor2": dict(expert=2, fsdp=2, tensor=2),
}
CASES = [("dense", m) for m in ("single", "fsdp8", "data2_fsdp2_tensor2")] + [
    ("moe", m) for m in ("single", "fsdp8", "data2_fsdp2_tensor2", "expert4_fsdp2", "expert2_fsdp2_tensor2")] + [
    ("moe_lora", m) for m in ("single", "expert4_fsdp2", "expert2_fsdp2_tensor2")]


def flat(tree) -> dict[str, np.ndarray]:
    return dict(S.iter_to_host(tree))


def main() -> None:
    t0 = time.time()
    assert jax.device_count() == 8, jax.devices()
    ids_host = common.tokens()
    out: dict = {"cases": {}, "timing": {}}
    refs = {}
    for kind in ("dense", "moe", "moe_lora"):
        model = common.make_model(kind)
        loss, logits, grads = common.loss_and_grads(model, ids_host)
        refs[kind] = dict(loss=float(loss), logits=np.asarray(logits), grads=flat(grads),
                          params=flat(nnx.state(model, nnx.Param)))
    out["timing"]["reference"] = time.time() - t0

    for kind, mesh_name in CASES:
        t = time.time()
        cfg = S.MeshConfig(**MESHES[mesh_name])
        devices = jax.devices()[:1] if mesh_name == "single" else None
        mesh = S.make_mesh(cfg, devices)
        rules = cfg.logical_rules()
        factory = functools.partial(common.make_model, kind, mesh, rules)
        model = S.init_sharded(factory, mesh, rules)
        params = nnx.state(model, nnx.Param)
        ref = refs[kind]

        # Placement: every parameter carries the sharding its logical axes + rules give.
        expected = S.state_specs(params, mesh, rules)
        placed = {}
        shard_shapes = {}
        for path, var in jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable)):
            name = S.placement.path_str(path)
            value = var.get_value()
            placed[name] = [list(a) if isinstance(a, tuple) else a for a in value.sharding.spec]
            shard_shapes[name] = sorted({tuple(s.data.shape) for s in value.addressable_shards})
        spec_mismatch = {
            n: (placed[n], str(expected[n])) for n in placed
            if tuple(tuple(a) if isinstance(a, list) else a for a in placed[n]) != tuple(expected[n])
        }
        init_diff = max(float(np.max(np.abs(v - ref["params"][n]))) for n, v in flat(params).items())

        ids = S.make_global_batch(ids_host, mesh, rules)
        loss, logits, grads = common.loss_and_grads(model, ids)
        g = flat(grads)
        grad_errs = {n: common.rel_err(g[n], ref["grads"][n]) for n in ref["grads"]}

        # Memory: measured addressable bytes per device vs. the shape-based report.
        measured = S.device_bytes(params)
        report = S.memory_report(model, mesh, rules, optimizer="adamw")
        abstract = nnx.eval_shape(factory)
        abstract_report_equal = S.memory_report(abstract, mesh, rules, optimizer="adamw") == report
        out["cases"][f"{kind}/{mesh_name}"] = dict(
            mesh=dict(mesh.shape),
            loss=float(loss), ref_loss=ref["loss"],
            loss_rel_err=abs(float(loss) - ref["loss"]) / abs(ref["loss"]),
            logits_rel_err=common.rel_err(S.gather_to_host(logits), ref["logits"]),
            logits_sharding=str(logits.sharding.spec),
            grad_max_rel_err=max(grad_errs.values()),
            grad_worst=max(grad_errs, key=grad_errs.get),
            init_max_abs_diff=init_diff,
            specs=placed, shard_shapes=shard_shapes, spec_mismatch=spec_mismatch,
            measured_bytes_per_device=sorted(set(measured.values())),
            measured_devices=len(measured),
            report_param_bytes=report.param_bytes,
            report_param_bytes_per_device=report.param_bytes_per_device,
            report_opt_bytes_per_device=report.opt_state_bytes_per_device,
            report_replicated_param_bytes=report.replicated_param_bytes,
            report=str(report), abstract_report_equal=abstract_report_equal,
        )
        out["timing"][f"{kind}/{mesh_name}"] = time.time() - t

    # shard_model (device_put of an eagerly built model) == init_sharded; optimizer-state shardings.
    t = time.time()
    cfg = S.MeshConfig(data=2, fsdp=2, tensor=2)
    mesh, rules = S.make_mesh(cfg), cfg.logical_rules()
    eager = S.shard_model(common.make_model("dense", mesh, rules), mesh, rules)
    e_params = nnx.state(eager, nnx.Param)
    expected_specs = S.state_specs(e_params, mesh, rules)
    same_placement = all(
        str(v.sharding.spec) == str(expected_specs[S.placement.path_str(p)])
        for p, v in jax.tree_util.tree_leaves_with_path(e_params)
    )
    shard_model_diff = max(float(np.max(np.abs(v - refs["dense"]["params"][n]))) for n, v in flat(e_params).items())

    tx = optax.adamw(1e-3)
    abstract_opt = jax.eval_shape(tx.init, e_params)
    opt_shardings = S.opt_state_shardings(abstract_opt, e_params, mesh, rules)
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(e_params)
    mu, nu, count = opt_state[0].mu, opt_state[0].nu, opt_state[0].count
    p_specs = {S.placement.path_str(p): str(v.sharding.spec) for p, v in jax.tree_util.tree_leaves_with_path(e_params)}
    mu_specs = {S.placement.path_str(p): str(v.sharding.spec) for p, v in jax.tree_util.tree_leaves_with_path(mu)}
    nu_specs = {S.placement.path_str(p): str(v.sharding.spec) for p, v in jax.tree_util.tree_leaves_with_path(nu)}
    # Same, for a plain nested dict of arrays (no Variables, no metadata): path-suffix matching.
    pure = nnx.to_pure_dict(e_params)
    pure_opt = jax.eval_shape(tx.init, pure)
    pure_sh = S.opt_state_shardings(pure_opt, pure, mesh, param_shardings=jax.tree.map(lambda a: a.sharding, pure))
    pure_mu_specs = {S.placement.path_str(p): str(s.spec) for p, s in jax.tree_util.tree_leaves_with_path(
        pure_sh[0].mu, is_leaf=lambda s: isinstance(s, jax.sharding.NamedSharding))}
    # nnx.Optimizer copies the logical axes onto its moments: shard_model places it directly.
    optimizer = S.shard_model(nnx.Optimizer(eager, tx, wrt=nnx.Param), mesh, rules)
    o_state = nnx.state(optimizer)
    nnx_mu_specs = {S.placement.path_str(p): str(v.sharding.spec)
                    for p, v in jax.tree_util.tree_leaves_with_path(o_state["opt_state"][0]["mu"])}
    out["extra"] = dict(
        shard_model_same_placement=same_placement,
        shard_model_max_abs_diff=shard_model_diff,
        param_specs=p_specs, mu_specs=mu_specs, nu_specs=nu_specs, pure_mu_specs=pure_mu_specs,
        nnx_mu_specs=nnx_mu_specs,
        count_spec=str(count.sharding.spec), count_replicated=bool(count.sharding.is_fully_replicated),
        unknown_logical_axes=S.unknown_logical_axes(eager),
    )
    out["timing"]["extra"] = time.time() - t

    # Memory of a larger (~4.1M parameter) model: measured per-device bytes vs. total / shards.
    t = time.time()
    big = common.CONFIGS["dense"].replace(vocab_size=4096, hidden_size=256, intermediate_size=1024,
                                          num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                                          num_hidden_layers=2)
    out["memory"] = {}
    for mesh_name in ("fsdp8", "data2_fsdp2_tensor2"):
        cfg = S.MeshConfig(**MESHES[mesh_name])
        mesh, rules = S.make_mesh(cfg), cfg.logical_rules()
        def factory(mesh=mesh, rules=rules):  # creates its own Rngs: init_sharded traces it twice
            return common.Transformer(big, rngs=nnx.Rngs(0), mesh=mesh, rules=rules)

        params = nnx.state(S.init_sharded(factory, mesh, rules), nnx.Param)
        measured = S.device_bytes(params)
        report = S.memory_report(nnx.eval_shape(factory), mesh, rules)
        out["memory"][mesh_name] = {
            "total_bytes": report.param_bytes, "param_count": report.param_count,
            "measured_bytes_per_device": sorted(set(measured.values())),
            "report_param_bytes_per_device": report.param_bytes_per_device,
            "report_opt_bytes_per_device": report.opt_state_bytes_per_device,
            "replicated_param_bytes": report.replicated_param_bytes,
        }
    out["timing"]["memory"] = time.time() - t
    t = time.time()
    out["moe_collectives"] = moe_block_collectives(S.MeshConfig(expert=4, fsdp=2))
    out["moe_collectives_fsdp8"] = moe_block_collectives(S.MeshConfig(fsdp=8))
    out["moe_collectives_bf16"] = moe_block_collectives(S.MeshConfig(expert=4, fsdp=2), dtype="bfloat16")
    out["timing"]["moe_collectives"] = time.time() - t
    out["timing"]["total"] = time.time() - t0
    print(json.dumps(out))


def moe_block_collectives(cfg, dtype: str = "float32") -> dict:
    """The collectives XLA compiles for one MoE block's forward and backward on the mesh of ``cfg`` (computing in
    ``dtype``): op -> the element counts of their results; op -> [element count, element type] of each as jrl
    wrote them (the HLO before XLA's passes: XLA:CPU widens bfloat16 collectives to float32); the element counts of
    the tokens and of the block's parameters."""
    from jrl.models.moe import MoE

    mesh, rules = S.make_mesh(cfg), cfg.logical_rules()
    config = common.CONFIGS["moe"].replace(dtype=dtype)
    block = S.shard_model(MoE(config, rngs=nnx.Rngs(0), mesh=mesh, rules=rules), mesh, rules)
    shape = (common.BATCH, common.SEQ, config.hidden_size)
    x = jax.device_put(np.random.default_rng(0).normal(size=shape).astype(dtype),
                       S.logical_sharding(("batch", "activation_length", "embed"), mesh, rules, shape))
    step = nnx.jit(nnx.grad(lambda m, x: (m(x).astype(jnp.float32) ** 2).sum(), argnums=(0, 1)))
    lowered = step.lower(block, x)
    params = sum(x.size for x in jax.tree.leaves(nnx.state(block, nnx.Param)))
    return dict(collectives={op: [sum(n for n, _ in arrays) for arrays in found]
                             for op, found in _collectives(lowered.compile().as_text()).items()},
                typed={op: [list(a) for arrays in found for a in arrays]
                       for op, found in _collectives(lowered.as_text(dialect="hlo")).items()},
                token_elements=math.prod(shape), param_elements=int(params))


def _collectives(hlo: str) -> dict[str, list[list[tuple[int, str]]]]:
    """op -> for each collective of ``hlo`` (HLO text), the (element count, element type) of its result arrays."""
    found: dict[str, list] = {}
    for line in hlo.splitlines():
        m = re.search(r"= (\(?[^=]*?\)?) (all-to-all|all-gather|all-reduce|reduce-scatter|collective-permute)"
                      r"(-start)?\(", line)
        if m:
            found.setdefault(m.group(2), []).append(
                [(math.prod(int(d) for d in dims.split(",") if d), t) for t, dims in re.findall(
                    r"(\w+)\[([\d,]*)\]", m.group(1))])
    return found


if __name__ == "__main__":
    sys.exit(main())
