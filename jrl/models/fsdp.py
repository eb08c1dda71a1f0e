"""The model's large pieces, the token lookup, the scanned decoder layers and the loss-fused LM head, run per device
on a mesh of ``data`` and ``fsdp`` axes, with their weights' FSDP collectives placed by hand
(:mod:`jrl.sharding.collectives`).

Layers: inside one ``shard_map`` the scan over the stacked layers gathers each layer's weight shards inside the
layer's rematerialisation checkpoint, so the gathered weights are never saved for the backward: the backward
gathers them again, and reduce-scatters each layer's weight gradient as its backward finishes. A few layers'
gathered weights exist at once, not the whole model's (15 GiB per device for an 8B model, which were kept before;
with ``remat="none"`` there is no checkpoint and they are kept).
The scan is unrolled by two: each loop iteration holds two layers, so XLA's scheduler starts the second layer's
gather while the first computes, and buffers carried between iterations are not copied (``benchmarks/RESULTS.md``,
"Scale-out": as fast as gathering a layer ahead in the scan's carry, and 7 GiB less per device for 16 layers of
the 8B model's width at fsdp=2).
With ``ModelConfig.fsdp_layers_per_gather`` = P the layers run in groups of P instead, one scan each (the groups
unrolled: a scan over the groups measured slower, its copies of the stacked weights and residuals, RESULTS
twenty-first session): a group's weights are gathered before its first layer (one collective per weight and group)
and kept for the backward, which gathers nothing and reduce-scatters the group's gradient when it leaves the
group. The collectives are fewer and larger and move the weights once instead of twice; the whole weights are on
every device by the end of the forward.

Token lookup: each device looks up its FSDP group's tokens in its own columns of the embedding table and one
all-to-all hands each device its rows' vectors (:func:`embed_lookup`); the table is not gathered for it and its
gradient from the lookup needs no reduce-scatter.

Head: the hidden rows stay split over the devices and each device computes its rows' loss against the gathered
head weight; the head's gradient is summed over the rows of a device and reduce-scattered once. The log-prob kernel
(:func:`token_logprobs`: packed rows, old and reference log-probs, EBFT) runs the same way, each device on its rows.

Without this, XLA's partitioner gathers each layer's weights in the iteration that uses them and keeps them for the
backward, and splits the head matmul on the hidden dimension with float32 all-reduces of every chunk's logits:
``benchmarks/RESULTS.md`` ("Scale-out") has the profiles. Both paths compute the same function; the automatic one
is the reference the tests compare with, and the one used for meshes with ``tensor`` or ``expert`` axes and for
MoE models' layers (their token lookup and head run per device too).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from jrl.kernels.logprobs import fused_head_loss
from jrl.kernels.logprobs import token_logprobs as kernel_token_logprobs
from jrl.models.remat import remat
from jrl.sharding.collectives import batch_axes, gather_shards, only_axes, spec_gathers
from jrl.sharding.placement import variable_spec
from jrl.sharding.rules import DEFAULT_RULES

#: The mesh axes the per-device path handles (any others leave the model to XLA's partitioner).
AXES = ("data", "fsdp")
#: Layers per iteration of the per-device layer scan (module docstring).
UNROLL = 2


def explicit_axes(config, mesh: Mesh | None, rules: Mapping | None, rows: int, *,
                  layers: bool = True) -> tuple[str, ...] | None:
    """The batch axes of the per-device path when it applies to ``rows`` rows on ``mesh``: ``config.fsdp_prefetch``,
    only ``data``/``fsdp`` axes with ``fsdp`` > 1, rows that divide among the batch axes, and for the decoder
    ``layers`` a dense model (the head runs per device for MoE models too)."""
    if mesh is None or not config.fsdp_prefetch or (layers and config.is_moe) or not only_axes(mesh, AXES):
        return None
    if mesh.shape.get("fsdp", 1) == 1:
        return None
    return batch_axes(mesh, DEFAULT_RULES if rules is None else rules, rows)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def scan_layers(step: Callable, state, x: jax.Array, positions: jax.Array, mask, *, mesh: Mesh, rules: Mapping,
                axes: tuple[str, ...], collect: bool, dtype: str, reduce_dtype: str | None, remat_name: str,
                layers_per_gather: int = 0):
    """``jax.lax.scan`` of ``step(layer_state, h, positions, mask) -> h`` over the stacked layer ``state``, each
    layer's weights gathered inside the layer's ``remat_name`` checkpoint, or with ``layers_per_gather`` = P >= 1 the
    layers in groups of P (the last group holds what remains), each group's weights gathered before its first layer
    and kept for the backward (``ModelConfig.fsdp_layers_per_gather``; module docstring).

    ``step`` must build its layer from a graph definition without a mesh (it runs per device). Returns (output,
    every layer's output stacked [L, B, T, H] when ``collect``, else None)."""
    variables, treedef = jax.tree.flatten(state, is_leaf=_is_variable)
    values = [v.get_value() for v in variables]
    specs = [variable_spec(v, mesh, rules) for v in variables]
    gathers = [spec_gathers(spec, np.ndim(a), skip=1) for spec, a in zip(specs, values)]
    rows = PartitionSpec(axes)

    def layer(weights, h, positions, mask):
        return step(jax.tree.unflatten(treedef, [v.replace(a) for v, a in zip(variables, weights)]), h, positions,
                    mask)

    def whole(shards, stacked: int = 0):
        """The weights of ``shards`` gathered, each with ``stacked`` leading layer dimensions."""
        return [gather_shards(a, tuple((d + stacked, names) for d, names in g), dtype, reduce_dtype) if g else a
                for a, g in zip(shards, gathers)]

    def layer_of_shards(shards, h, positions, mask):
        return layer(whole(shards), h, positions, mask)

    def scanned(run, h, stack, positions, mask):
        def body(h, weights):
            h = run(weights, h, positions, mask)
            return h, h if collect else None

        return jax.lax.scan(body, h, stack, unroll=UNROLL)

    def per_layer(values, x, positions, mask):
        return scanned(remat(layer_of_shards, remat_name, prevent_cse=False), x, values, positions, mask)

    def per_group(values, x, positions, mask):
        run = remat(layer, remat_name, prevent_cse=False)
        outputs = []
        for lo in range(0, values[0].shape[0], layers_per_gather):
            x, stacked = scanned(run, x, whole([a[lo:lo + layers_per_gather] for a in values], stacked=1), positions,
                                 mask)
            outputs.append(stacked)
        return x, jnp.concatenate(outputs) if collect else None

    out_specs = (rows, PartitionSpec(None, axes) if collect else PartitionSpec())
    fn = jax.shard_map(per_group if layers_per_gather else per_layer, mesh=mesh, check_vma=False,
                       in_specs=(specs, rows, rows, jax.tree.map(lambda _: rows, mask)), out_specs=out_specs)
    return fn(values, x, positions, mask)


def embed_lookup(weight: nnx.Variable, ids: jax.Array, *, mesh: Mesh, rules: Mapping, axes: tuple[str, ...],
                 dtype) -> jax.Array | None:
    """The token embedding of each device's rows of ``ids`` [R, T] from the table ``weight`` [V, H] without gathering
    the table: each device looks up every token of its FSDP group in its own columns of the table and one all-to-all
    hands each device its rows' whole vectors ([R, T, H] in ``dtype``, split like the rows). The backward moves the
    same [R, T, H] back and adds each device's columns into its shard, so the table's gradient from the lookup needs
    no reduce-scatter. XLA's partitioning gathers the whole table for the lookup instead, at the start of the step
    with nothing to overlap it, and reduce-scatters its gradient, added to the tied head's, at the end.

    None where the table is not split on its hidden dimension alone, over batch ``axes`` (the caller keeps the
    partitioned lookup)."""
    spec = variable_spec(weight, mesh, rules)  # names no mesh axis of size 1
    gathers = spec_gathers(spec, 2)
    if [dim for dim, _ in gathers] != [1] or not set(gathers[0][1]) <= set(axes):
        return None
    group = gathers[0][1]

    def per_device(table, ids):
        tokens = jax.lax.all_gather(ids, group, axis=0, tiled=True)
        columns = jnp.take(table, tokens, axis=0).astype(dtype)
        return jax.lax.all_to_all(columns, group, split_axis=0, concat_axis=columns.ndim - 1, tiled=True)

    split = PartitionSpec(axes)
    return jax.shard_map(per_device, mesh=mesh, check_vma=False, in_specs=(spec, split),
                         out_specs=split)(weight.get_value(), ids)


def _head_gather(weight: nnx.Variable, mesh: Mesh, rules: Mapping, dtype: str | None, reduce_dtype: str | None,
                 transpose: bool) -> tuple[PartitionSpec, Callable[[jax.Array], jax.Array]]:
    """(the head ``weight``'s spec, the per-device function from its shard to the whole head [H, V] in ``dtype``
    (None: its own), the gradient reduce-scattered in ``reduce_dtype``)."""
    spec = variable_spec(weight, mesh, rules)
    gathers = spec_gathers(spec, weight.get_value().ndim)

    def whole(shard):
        w = gather_shards(shard, gathers, dtype, reduce_dtype) if gathers else shard.astype(dtype or shard.dtype)
        return w.T if transpose else w

    return spec, whole


def head_loss(weight: nnx.Variable, transpose: bool, hidden: jax.Array, targets: jax.Array, row_loss: Callable, rows,
              aux, *, mesh: Mesh, rules: Mapping, axes: tuple[str, ...], dtype: str, reduce_dtype: str | None,
              temperature: float, with_entropy: bool):
    """:func:`jrl.kernels.logprobs.fused_head_loss` of each device's rows against the gathered head ``weight`` (the
    embedding [V, H] with ``transpose``, else the head kernel [H, V]); the loss summed over the devices, log-probs and
    entropies split like the rows (module docstring)."""
    spec, whole = _head_gather(weight, mesh, rules, dtype, reduce_dtype, transpose)
    split = PartitionSpec(axes)

    def per_device(w, hidden, targets, rows, aux):
        loss, lp, ent = fused_head_loss(hidden, whole(w), targets, row_loss, rows, aux, temperature=temperature,
                                        with_entropy=with_entropy)
        return loss[None], lp, ent

    fn = jax.shard_map(per_device, mesh=mesh, check_vma=False,
                       in_specs=(spec, split, split, jax.tree.map(lambda _: split, rows),
                                 jax.tree.map(lambda _: PartitionSpec(), aux)),
                       out_specs=(split, split, split if with_entropy else PartitionSpec()))
    loss, lp, ent = fn(weight.get_value(), hidden, targets, rows, aux)
    return jnp.sum(loss), lp, ent


def token_logprobs(weight: nnx.Variable, transpose: bool, hidden: jax.Array, targets: jax.Array, *, mesh: Mesh,
                   rules: Mapping, axes: tuple[str, ...], reduce_dtype: str | None, temperature: float,
                   with_entropy: bool, impl: str):
    """:func:`jrl.kernels.logprobs.token_logprobs` of each device's rows ``hidden`` [R, T, H] predicting ``targets``
    [R, T] against the gathered head ``weight`` (in its own dtype, as the one-device call reads it): (log-probs
    [R, T], entropies [R, T] or None), split like the rows. The log-prob kernel is a custom call on GPUs, which XLA's
    partitioner cannot split: left to it, every device would compute every row's log-probs."""
    spec, whole = _head_gather(weight, mesh, rules, None, reduce_dtype, transpose)
    split = PartitionSpec(axes)

    def per_device(w, hidden, targets):
        r, t, h = hidden.shape
        lp, ent = kernel_token_logprobs(hidden.reshape(r * t, h), whole(w), targets.reshape(r * t),
                                        temperature=temperature, with_entropy=with_entropy, impl=impl)
        return (lp.reshape(r, t), ent.reshape(r, t)) if with_entropy else lp.reshape(r, t)

    fn = jax.shard_map(per_device, mesh=mesh, check_vma=False, in_specs=(spec, split, split),
                       out_specs=(split, split) if with_entropy else split)
    out = fn(weight.get_value(), hidden, targets)
    return out if with_entropy else (out, None)
