"""A mixture-of-experts block on a mesh: expert parallelism (the experts split over a mesh axis), and the routed
experts computed per device on a ``data``/``fsdp`` mesh (:func:`moe_per_device`).

Each device routes its own tokens, sorts their (token, expert) copies by expert and sends every expert
shard its rows with one ``all_to_all`` over the expert axis; the shard regroups what it received by local
expert, runs its experts (grouped matmuls) and sends the rows back the same way. No device ever sees
another device's tokens it does not compute for, and the expert weights stay split (the default rules
gather them over ``fsdp`` only, as any FSDP weight).

Dispatch is dropless: the buffer each device sends to a shard holds all of its rows, so routing can send
every row to one shard without dropping any (a padded ``all_to_all``: a device sends ``ep x rows``
slots, mostly empty; ``jax.lax.ragged_all_to_all`` would send only the rows but has no CPU
implementation, so it is not used yet). The expert MLP width may be split too (``expert_mlp`` on the
``tensor`` axis): the down projection's partial sums are added over that axis.

Without an expert axis, on a mesh of ``data`` and ``fsdp`` axes, each device routes and sorts its own tokens and
runs them through the whole experts (their weights gathered, as any FSDP weight's, the gradient reduce-scattered
back).
Left to XLA's partitioner the block sorts the batch's tokens globally (all-reduces of token-sized arrays), and the
grouped matmul, a custom call on GPUs that the partitioner cannot split, would run every token on every device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jrl.kernels.moe import permute, unpermute
from jrl.sharding.collectives import gather_shards, only_axes, spec_gathers
from jrl.sharding.rules import DEFAULT_RULES, logical_to_spec

#: ``experts(rows [R, H], group_sizes [E_local], *expert_params) -> [R, H]``: the expert MLP on rows sorted by
#: (local) expert; rows past ``sum(group_sizes)`` are padding whose output is discarded.
ExpertsFn = Callable[..., jax.Array]

_TOKENS = ("batch", "activation_length", None)


def routed(x: jax.Array, router_weights: jax.Array, expert_ids: jax.Array, num_experts: int,
           run: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """The routed experts' weighted sum for tokens ``x`` [..., H] sent to ``expert_ids`` [..., K] with
    ``router_weights`` [..., K]: their (token, expert) copies sorted by expert go through ``run(sorted_rows,
    group_sizes)`` and come back summed per token."""
    k = expert_ids.shape[-1]
    perm = permute(x.reshape(-1, x.shape[-1]), expert_ids.reshape(-1, k), num_experts)
    return unpermute(run(perm.sorted_x, perm.group_sizes), perm, router_weights.reshape(-1, k)).reshape(x.shape)


def expert_axis(mesh: Mesh | None, rules: Mapping | None, expert_shape: tuple[int, ...],
                expert_axes: tuple[str | None, ...]) -> str | None:
    """The mesh axis the experts of a parameter with ``expert_axes`` (logical names) are split over, or
    ``None`` when they are whole on every device (no mesh, an axis of size 1, or E not divisible)."""
    if mesh is None:
        return None
    entry = logical_to_spec(expert_axes, mesh, rules, expert_shape)[0]
    if entry is None:
        return None
    if not isinstance(entry, str):
        if len(entry) != 1:
            raise ValueError(f"expert parallelism needs the 'expert' logical axis on one mesh axis; the rules "
                             f"put it on {entry}: map 'expert' to a single mesh axis")
        entry = entry[0]
    return entry


def moe_expert_parallel(x: jax.Array, router_weights: jax.Array, expert_ids: jax.Array, experts: ExpertsFn,
                        params: tuple[jax.Array, ...], param_axes: tuple[tuple[str | None, ...], ...], *,
                        num_experts: int, mesh: Mesh, rules: Mapping | None, axis: str) -> jax.Array:
    """The MoE output [B, S, H] for ``x`` [B, S, H] routed to ``expert_ids`` [B, S, K] with ``router_weights``
    [B, S, K] (float32), the experts split over mesh axis ``axis``.

    ``params`` are the expert parameters (leading dim E) with logical axes ``param_axes``; each device gets its
    ``E / ep`` experts whole along ``embed`` and split along ``expert_mlp`` as the rules say, and
    ``experts`` runs on them; the result is summed over the axes that split ``expert_mlp``.
    """
    rules = dict(rules) if rules is not None else None
    ep = mesh.shape[axis]
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by the '{axis}' mesh axis ({ep} devices)")
    gathered = {**(DEFAULT_RULES if rules is None else rules), "embed": None}
    param_specs = tuple(logical_to_spec(axes, mesh, gathered, p.shape) for p, axes in zip(params, param_axes))
    if any(spec[0] != axis for spec in param_specs):
        raise ValueError(f"every expert parameter must be split over '{axis}' on its expert dim; got {param_specs}")
    mlp_axes = sorted({a for spec in param_specs for entry in spec[1:] if entry is not None
                       for a in ((entry,) if isinstance(entry, str) else entry)})
    token_spec = logical_to_spec(_TOKENS, mesh, rules, x.shape)
    token_axes = {a for entry in token_spec if entry is not None for a in ((entry,) if isinstance(entry, str)
                                                                          else entry)}
    if token_axes & set(mlp_axes):
        raise ValueError(f"the rules split tokens and the expert MLP width over the same mesh axes "
                         f"{sorted(token_axes & set(mlp_axes))}; map 'batch' and 'expert_mlp' to different axes")
    route_spec = P(*token_spec[:2], None)

    def local(x, weights, ids, *params):
        return routed(x, weights, ids, num_experts, lambda rows, counts: _exchange(
            rows, counts, experts, params, axis=axis, ep=ep, mlp_axes=tuple(mlp_axes)))

    return jax.shard_map(local, mesh=mesh, in_specs=(token_spec, route_spec, route_spec, *param_specs),
                         out_specs=token_spec, check_vma=False)(x, router_weights, expert_ids, *params)


def per_device_tokens(mesh: Mesh | None, rules: Mapping | None, shape: tuple[int, ...]) -> P | None:
    """The token spec of :func:`moe_per_device` for tokens of ``shape`` [B, S, H], or None where it does not apply:
    no mesh, mesh axes other than ``data``/``fsdp``, or tokens that the rules leave whole."""
    if mesh is None or not only_axes(mesh, ("data", "fsdp")):
        return None
    spec = logical_to_spec(_TOKENS, mesh, rules, shape)
    return spec if any(entry is not None for entry in spec) else None


def moe_per_device(x: jax.Array, router_weights: jax.Array, expert_ids: jax.Array, experts: ExpertsFn,
                   params: tuple[jax.Array, ...], param_axes: tuple[tuple[str | None, ...], ...], *,
                   num_experts: int, mesh: Mesh, rules: Mapping | None, token_spec: P) -> jax.Array:
    """The MoE output [B, S, H] for ``x`` [B, S, H] (split as ``token_spec``, :func:`per_device_tokens`) routed to
    ``expert_ids`` [B, S, K] with ``router_weights`` [B, S, K]: each device sorts its own tokens by expert and runs
    ``experts`` on them with every expert's parameters (logical axes ``param_axes``) gathered whole; their gradients
    are reduce-scattered back (module docstring)."""
    route_spec = P(*token_spec[:2], None)
    param_specs = tuple(logical_to_spec(axes, mesh, rules, p.shape) for p, axes in zip(params, param_axes))
    gathers = tuple(spec_gathers(spec, p.ndim) for spec, p in zip(param_specs, params))

    def local(x, weights, ids, *shards):
        whole = [gather_shards(w, g) if g else w for w, g in zip(shards, gathers)]
        return routed(x, weights, ids, num_experts, lambda rows, counts: experts(rows, counts, *whole))

    return jax.shard_map(local, mesh=mesh, in_specs=(token_spec, route_spec, route_spec, *param_specs),
                         out_specs=token_spec, check_vma=False)(x, router_weights, expert_ids, *params)


def _exchange(sorted_x: jax.Array, counts: jax.Array, experts: ExpertsFn, params, *, axis: str, ep: int,
              mlp_axes: tuple[str, ...]) -> jax.Array:
    """One device's rows ``sorted_x`` [R, H] (sorted by global expert, ``counts`` [E] per expert) through their
    experts on the shards that own them, back in the same order."""
    rows, hidden = sorted_x.shape
    local_experts = counts.shape[0] // ep
    # Where each of my rows goes: shard ``dest`` (experts are contiguous per shard), slot ``slot`` there.
    send_sizes = counts.reshape(ep, local_experts).sum(axis=1)
    send_ends = jnp.cumsum(send_sizes)
    dest = jnp.searchsorted(send_ends, jnp.arange(rows), side="right")
    slot = jnp.arange(rows) - (send_ends - send_sizes)[dest]
    outbox = jnp.zeros((ep, rows, hidden), sorted_x.dtype).at[dest, slot].set(sorted_x)
    inbox = jax.lax.all_to_all(outbox, axis, 0, 0)  # inbox[s]: rows source s sent me, sorted by local expert
    # Rows per (source, local expert): the sources' counts of my experts.
    me = jax.lax.axis_index(axis)
    all_counts = jax.lax.all_gather(counts, axis)  # [ep, E]
    recv_counts = jax.lax.dynamic_slice_in_dim(all_counts, me * local_experts, local_experts, axis=1)
    recv_ends = jnp.cumsum(recv_counts, axis=1)
    local_expert = jax.vmap(lambda ends: jnp.searchsorted(ends, jnp.arange(rows), side="right"))(recv_ends)
    order = jnp.argsort(local_expert.reshape(-1), stable=True)  # padding (= local_experts) sorts last
    grouped = jnp.take(inbox.reshape(ep * rows, hidden), order, axis=0)
    y = experts(grouped, recv_counts.sum(axis=0).astype(jnp.int32), *params)
    if mlp_axes:
        y = jax.lax.psum(y, mlp_axes)
    y_inbox = jnp.zeros_like(y).at[order].set(y).reshape(ep, rows, hidden)
    returned = jax.lax.all_to_all(y_inbox, axis, 0, 0)  # returned[d]: my rows' outputs from shard d
    return returned[dest, slot]
