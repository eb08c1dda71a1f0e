"""A mixture-of-experts block on a mesh: expert parallelism (the experts split over a mesh axis), and the routed
experts computed per device on a ``data``/``fsdp`` mesh (:func:`moe_per_device`).

Each device gathers the tokens (and their routing) of the devices along the expert axis, runs its own experts on
the rows routed to them and hands every token's summed partial outputs back to the device that owns it
(reduce-scatter, float32); in the backward the same two collectives run the other way (the output's cotangent
gathered in the tokens' dtype). A device moves its tokens once, not once per chosen expert: ``(ep - 1) x tokens``
rows each way, against ``top_k`` copies of each token for an all-to-all dispatch, which the padded form (dropless
without a ragged exchange) multiplies by ``ep`` again.
Up to ``ep = top_k`` devices (Qwen3-MoE: top-8) this is the least traffic of the three; beyond, a ragged
all-to-all would send less, but ``jax.lax.ragged_all_to_all`` ran 12-54x slower than the padded one on H100s with
jax 0.11.2 and has no CPU implementation. By default dispatch is dropless: a device sorts all ``ep x tokens x top_k``
rows of its peers' tokens, the rows of other devices' experts last, past its groups (routed nowhere,
:mod:`jrl.kernels.moe.routing`), and on a GPU nothing between the sort and the reduce-scatter reads or computes those
rows: the grouped matmuls, the SwiGLU and the row gathers (:mod:`jrl.kernels.moe.rows`) neither compute nor
write them, and the combine reads only routed rows. With a capacity (``ModelConfig.expert_capacity`` C >= 1) only
the first ``C x tokens x top_k`` sorted rows are copied, run and combined (C times the device's even share); the
device's own rows past them are dropped (capacity-factor routing).
The expert MLP width may be split too (``expert_mlp`` on the ``tensor`` axis): the down projection's partial sums
are added over that axis. ``ModelConfig.expert_chunks`` K runs a device's tokens as K independent chunks (gather,
experts, reduce-scatter each), which leaves XLA free to run one chunk's collectives beside another's experts.

Without an expert axis, on a mesh of ``data`` and ``fsdp`` axes, each device routes and sorts its own tokens and
runs them through the whole experts (their weights gathered, as any FSDP weight's, the gradient reduce-scattered
back).
Left to XLA's partitioner the block sorts the batch's tokens globally (all-reduces of token-sized arrays), and the
grouped matmul, a custom call on GPUs that the partitioner cannot split, would run every token on every device.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jrl.kernels.moe import permute, unpermute
from jrl.sharding.collectives import gather_shards, only_axes, spec_gathers
from jrl.sharding.rules import DEFAULT_RULES, logical_to_spec

#: ``experts(rows [R, H], group_sizes [E_local], *expert_params, rows_in_use=None) -> [R, H]``: the expert MLP on
#: rows sorted by (local) expert; rows past ``sum(group_sizes)`` are padding whose output is discarded.
#: ``rows_in_use`` (traced, ``sum(group_sizes)``) is passed where most of the buffer may be such padding (an
#: expert-parallel device's), so that the matmuls and the elementwise work between them can skip it: the input's
#: rows past it may then be unwritten (``permute(..., fill_unrouted=False)``), and so may the output's (the combine
#: reads only routed rows).
ExpertsFn = Callable[..., jax.Array]

_TOKENS = ("batch", "activation_length", None)


def routed(x: jax.Array, router_weights: jax.Array, expert_ids: jax.Array, num_experts: int,
           run: Callable[[jax.Array, jax.Array], jax.Array], dtype=None, capacity: int | None = None,
           fill_unrouted: bool = True) -> jax.Array:
    """The routed experts' weighted sum for tokens ``x`` [..., H] sent to ``expert_ids`` [..., K] with
    ``router_weights`` [..., K]: their (token, expert) copies sorted by expert go through ``run(sorted_rows,
    group_sizes)`` and come back summed per token (in ``dtype``; default: ``run``'s output dtype). ``capacity``:
    only the first ``capacity`` sorted rows are copied and run, the others count as zeros. ``fill_unrouted``: as
    :func:`jrl.kernels.moe.permute`'s (False where ``run`` reads no row past the groups)."""
    k = expert_ids.shape[-1]
    perm = permute(x.reshape(-1, x.shape[-1]), expert_ids.reshape(-1, k), num_experts, capacity,
                   fill_unrouted=fill_unrouted)
    return unpermute(run(perm.sorted_x, perm.group_sizes), perm, router_weights.reshape(-1, k), dtype,
                     fill_unrouted=fill_unrouted).reshape(x.shape)


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
                        num_experts: int, mesh: Mesh, rules: Mapping | None, axis: str,
                        capacity: float = 0.0, chunks: int = 1) -> tuple[jax.Array, jax.Array]:
    """The MoE output [B, S, H] for ``x`` [B, S, H] routed to ``expert_ids`` [B, S, K] with ``router_weights``
    [B, S, K] (float32), the experts split over mesh axis ``axis``, and the share of the routed rows that the
    ``capacity`` dropped (a float32 scalar; 0 dropless).

    ``params`` are the expert parameters (leading dim E) with logical axes ``param_axes``; each device gets its
    ``E / ep`` experts whole along ``embed`` and split along ``expert_mlp`` as the rules say, and
    ``experts`` runs on them; the result is summed over the axes that split ``expert_mlp``. ``capacity``: the
    rows a device runs, as a multiple of its even share (:func:`capacity_rows`); 0: every row slot (dropless).
    ``chunks``: the device's tokens in that many chunks, each through the collectives and experts on its own
    (``ModelConfig.expert_chunks``).
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
        tokens = math.prod(x.shape[:-1])
        if tokens % chunks:
            raise ValueError(f"ModelConfig.expert_chunks={chunks} does not divide a device's {tokens} tokens; use a "
                             f"divisor of {tokens}")
        split = lambda a: jnp.split(a.reshape(tokens, -1), chunks)  # noqa: E731
        run = functools.partial(_local_experts, experts=experts, params=params, axis=axis, ep=ep,
                                num_experts=num_experts, tokens_split=axis in token_axes, mlp_axes=tuple(mlp_axes),
                                capacity=capacity, other_axes=tuple(a for a in mesh.axis_names if a != axis))
        outs = [run(*chunk) for chunk in zip(split(x), split(weights), split(ids))]
        y = jnp.concatenate([o[0] for o in outs]).reshape(x.shape)
        return y, sum(o[1] for o in outs) / chunks

    return jax.shard_map(local, mesh=mesh, in_specs=(token_spec, route_spec, route_spec, *param_specs),
                         out_specs=(token_spec, P()), check_vma=False)(x, router_weights, expert_ids, *params)


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


def _local_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, *, experts: ExpertsFn, params, axis: str,
                   ep: int, num_experts: int, tokens_split: bool, mlp_axes: tuple[str, ...],
                   capacity: float, other_axes: tuple[str, ...]) -> tuple[jax.Array, jax.Array]:
    """One device's tokens ``x`` [T, H] (routed to ``ids`` [T, K] with ``weights``) through every expert: the
    tokens of the devices along ``axis`` gathered (when ``tokens_split``), each device runs its own experts on the
    rows routed to them (:func:`own_experts`), and the partial sums of every token's experts are added over ``axis``
    and handed back to the device that owns the token. Also returns the share of the routed rows dropped (every
    device's, the same on each)."""
    if tokens_split:
        x, weights, ids = (jax.lax.all_gather(a, axis, axis=0, tiled=True) for a in (x, weights, ids))
    rows = capacity_rows(capacity, ids.size, ep)
    y, mine = own_experts(x, weights, ids, experts, params, device=jax.lax.axis_index(axis),
                          local_count=num_experts // ep, rows=rows)
    if tokens_split and not mlp_axes:
        y = _summed_to_owners(y, axis, x.dtype)
    else:
        y = jax.lax.psum_scatter(y, axis, scatter_dimension=0, tiled=True) if tokens_split else jax.lax.psum(y, axis)
        y = (jax.lax.psum(y, mlp_axes) if mlp_axes else y).astype(x.dtype)
    dropped = jnp.zeros((), jnp.float32)
    if rows is not None:  # this device's rows past its buffer, over its token group's rows, averaged over the groups
        dropped = jax.lax.psum(jnp.maximum(jnp.sum(mine) - rows, 0).astype(jnp.float32), axis) / ids.size
        dropped = jax.lax.pmean(dropped, other_axes) if other_axes else dropped
    return y, dropped


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _summed_to_owners(y: jax.Array, axis: str, dtype) -> jax.Array:
    """The float32 partial sums ``y`` [ep x T, H] added over ``axis``, each device keeping its own T tokens, in
    ``dtype``. The backward all-gathers the output's cotangent in ``dtype`` and widens it after: the same values as
    widening it first, which is what differentiating the cast and the reduce-scatter would do, in half the bytes
    for bfloat16."""
    return jax.lax.psum_scatter(y, axis, scatter_dimension=0, tiled=True).astype(dtype)


def _summed_to_owners_fwd(y, axis, dtype):
    return _summed_to_owners(y, axis, dtype), None


def _summed_to_owners_bwd(axis, dtype, _, ct):
    return (jax.lax.all_gather(ct.astype(dtype), axis, axis=0, tiled=True).astype(jnp.float32),)


_summed_to_owners.defvjp(_summed_to_owners_fwd, _summed_to_owners_bwd)


def own_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, experts: ExpertsFn, params, *, device,
                local_count: int, rows: int | None) -> tuple[jax.Array, jax.Array]:
    """What expert-parallel device ``device`` computes between its collectives: the tokens ``x`` [..., H] of every
    device on its axis (routed to ``ids`` [..., K] with ``weights``) through this device's ``local_count`` experts
    (``params``, experts ``device x local_count ..`` of the model), float32 partial sums per token (zero for a token
    none of whose experts are here), and the mask of the (token, expert) rows routed here. The other rows sort last,
    past the groups, and count as zeros; with ``rows`` (:func:`capacity_rows`) only the first ``rows`` sorted rows
    are copied and run, the rest dropped. One device's work alone, so it can be timed without the others
    (``benchmarks/scaling.py moe --own-experts``)."""
    local = ids - device * local_count
    mine = (local >= 0) & (local < local_count)

    def run(sorted_rows, counts):
        if rows is not None:  # the groups cut at the buffer's end: the rows past it are not there
            counts = jnp.diff(jnp.minimum(jnp.cumsum(counts), rows), prepend=0)
        return experts(sorted_rows, counts, *params, rows_in_use=jnp.sum(counts))

    # The other devices' rows are routed nowhere (``permute``), their sorted rows left unwritten: the experts, told
    # the rows in use, read none of them. A token's partial sum over this device's experts stays float32 until the
    # sums of every device are added.
    y = routed(x, weights, jnp.where(mine, local, local_count), local_count, run, dtype=jnp.float32, capacity=rows,
               fill_unrouted=False)
    return y, mine


def capacity_rows(capacity: float, slots: int, ep: int) -> int | None:
    """The static row buffer of one expert-parallel device for ``slots`` (token, expert) row slots gathered over
    ``ep`` devices at ``capacity`` times the even share ``slots / ep`` (rounded up to 8 rows), or None where that
    would hold every slot anyway (or ``capacity`` is 0: dropless)."""
    if capacity <= 0:
        return None
    rows = -(-math.ceil(capacity * slots / ep) // 8) * 8
    return rows if rows < slots else None
