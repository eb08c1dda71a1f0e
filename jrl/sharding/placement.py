"""Place NNX models and optimizer states on a mesh by their logical axes, and bring them back to host.

Every ``nnx.Variable`` that carries ``logical_axes`` metadata (one logical name or ``None`` per
dimension) is sharded by the rules; variables without it (RNG state, counters) are replicated. The
functions work on a module, on an ``nnx.State`` (concrete or abstract, from ``nnx.eval_shape``) and
on plain pytrees of arrays.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from flax import errors as flax_errors
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jrl.sharding.rules import DEFAULT_RULES, MeshAxes, logical_to_spec, mesh_axes, undivided_dims

Rules = Mapping[str, MeshAxes]
logger = logging.getLogger("jrl.sharding")


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _var_value(var: nnx.Variable) -> Any:
    return var.get_value() if hasattr(var, "get_value") else var.value


def _as_state(tree: Any) -> Any:
    return nnx.state(tree) if isinstance(tree, nnx.Module) else tree


def path_str(path: tuple) -> str:
    """``layers.0.attn.q.kernel`` for a pytree key path (Variable ``.value`` keys dropped)."""
    return ".".join(str(k) for k in _norm_path(path))


def _norm_path(path: tuple) -> tuple:
    out = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(k.key)
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(k.idx)
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            out.append(k.key)
        else:
            out.append(str(k))
    if out and out[-1] in ("value", "raw_value"):
        out.pop()
    return tuple(out)


def variable_spec(var: nnx.Variable, mesh: Mesh, rules: Rules | None = None, path: str = "") -> PartitionSpec:
    """PartitionSpec of one variable from its ``logical_axes`` metadata (replicated without it)."""
    value = _var_value(var)
    shape = tuple(getattr(value, "shape", ()))
    axes = var.get_metadata().get("logical_axes") if hasattr(var, "get_metadata") else None
    if axes is None:
        return PartitionSpec()
    axes = tuple(axes)
    if len(axes) != len(shape):
        raise ValueError(
            f"{path or type(var).__name__}: logical_axes {axes} has {len(axes)} names but the value has "
            f"shape {shape}; give one logical name (or None) per dimension"
        )
    return logical_to_spec(axes, mesh, DEFAULT_RULES if rules is None else rules, shape)


def state_shardings(tree: Any, mesh: Mesh, rules: Rules | None = None) -> Any:
    """A tree of ``NamedSharding`` with the structure of ``nnx.state(tree)`` (or of ``tree`` if it is
    already a state / pytree): each Variable's sharding from its logical axes, every other array leaf
    replicated. Usable as ``jax.device_put`` target and as jit ``in_/out_shardings``."""
    state = _as_state(tree)

    def one(path, x):
        if _is_variable(x):
            return x.replace(NamedSharding(mesh, variable_spec(x, mesh, rules, path_str(path))))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_variable)


def state_specs(tree: Any, mesh: Mesh, rules: Rules | None = None) -> dict[str, PartitionSpec]:
    """``{path: PartitionSpec}`` for every array of ``tree`` (handy to print or to assert on)."""
    shardings = state_shardings(tree, mesh, rules)
    leaves = jax.tree_util.tree_leaves_with_path(shardings, is_leaf=lambda s: isinstance(s, NamedSharding))
    return {path_str(p): s.spec for p, s in leaves}


def shard_model(model: Any, mesh: Mesh, rules: Rules | None = None) -> Any:
    """Place every variable of ``model`` on ``mesh`` by its logical axes, in place.

    ``model`` is an ``nnx.Module`` (updated in place and returned; an ``nnx.Optimizer`` works too: its
    moment variables copy the parameters' ``logical_axes``), an ``nnx.State`` or any pytree (a placed
    copy is returned). For a model too large for one device use :func:`init_sharded` instead, which
    never materialises the unsharded parameters."""
    state = _as_state(model)
    check_placement(state, mesh, rules)
    placed = jax.device_put(state, state_shardings(state, mesh, rules))
    if isinstance(model, nnx.Module):
        nnx.update(model, placed)
        return model
    return placed


def init_sharded(factory: Callable[[], Any], mesh: Mesh, rules: Rules | None = None) -> Any:
    """Build ``factory()`` (e.g. ``lambda: Transformer(cfg, rngs=nnx.Rngs(0))``) directly sharded: the
    initialisers run under ``jit`` with the rule shardings as outputs, so each device only ever holds
    its own shards. Gives the same values as ``shard_model(factory(), mesh)``. Works multi-host.

    ``factory`` is traced twice (shapes, then values), so it must create its own ``nnx.Rngs``
    rather than capture one built outside."""
    try:
        abstract = nnx.eval_shape(factory)
    except flax_errors.TraceContextError as e:
        raise ValueError(
            "init_sharded: the factory mutates state created outside it (usually an nnx.Rngs passed in); "
            "create the Rngs inside the factory, e.g. lambda: Model(cfg, rngs=nnx.Rngs(0))"
        ) from e
    graphdef, abstract_state = nnx.split(abstract)
    check_placement(abstract_state, mesh, rules)
    shardings = state_shardings(abstract_state, mesh, rules)

    def build():
        return nnx.state(factory())

    state = jax.jit(build, out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def opt_state_shardings(
    opt_state: Any,
    params: Any,
    mesh: Mesh,
    rules: Rules | None = None,
    param_shardings: Any = None,
) -> Any:
    """Shardings for an optax state (concrete or from ``jax.eval_shape(tx.init, params)``).

    Each subtree of the state with the structure and shapes of ``params`` (``mu``/``nu`` of Adam, momentum, ...)
    gets the parameters' own shardings, leaf for leaf. Elsewhere (a transform that keeps only part of the tree):
    Variables that carry ``logical_axes`` use their own, a leaf whose key path ends with the path of a parameter of
    the same shape gets that parameter's sharding; scalars (step counts) and anything else are replicated.
    ``params`` is the module or state the optimizer was built on; ``param_shardings`` (default: from ``params``'s
    logical axes) may be given instead to follow an existing placement."""
    if param_shardings is None:
        param_shardings = state_shardings(params, mesh, rules)
    by_path: dict[tuple, tuple[tuple, NamedSharding]] = {}
    params_tree = _as_state(params)
    p_leaves = jax.tree_util.tree_leaves_with_path(params_tree)
    s_leaves = jax.tree_util.tree_leaves(param_shardings, is_leaf=lambda s: isinstance(s, NamedSharding))
    if len(p_leaves) != len(s_leaves):
        raise ValueError(
            f"opt_state_shardings: params has {len(p_leaves)} arrays but param_shardings has "
            f"{len(s_leaves)}; pass the shardings of the same params tree"
        )
    for (p, x), s in zip(p_leaves, s_leaves, strict=True):
        by_path[_norm_path(p)] = (tuple(np.shape(x)), s)
    longest = max((len(k) for k in by_path), default=0)
    replicated = NamedSharding(mesh, PartitionSpec())

    structure, shapes = jax.tree.structure(params_tree), [tuple(np.shape(x)) for _, x in p_leaves]

    def mirrors(node) -> bool:
        """A subtree laid out as the parameters (the structure holds the shapes' leaves, checked too)."""
        return (jax.tree.structure(node) == structure
                and [tuple(np.shape(x)) for x in jax.tree.leaves(node)] == shapes)

    def one(path, x):
        if not _is_variable(x) and mirrors(x):
            return jax.tree.unflatten(jax.tree.structure(x), s_leaves)
        if _is_variable(x):
            axes = x.get_metadata().get("logical_axes") if hasattr(x, "get_metadata") else None
            if axes is not None:
                return x.replace(NamedSharding(mesh, variable_spec(x, mesh, rules, path_str(path))))
            inner = _norm_path(path)
            sharding = _match(inner, tuple(np.shape(_var_value(x))), by_path, longest) or replicated
            return x.replace(sharding)
        return _match(_norm_path(path), tuple(np.shape(x)), by_path, longest) or replicated

    return jax.tree_util.tree_map_with_path(one, _as_state(opt_state),
                                            is_leaf=lambda x: _is_variable(x) or mirrors(x))


def _match(path: tuple, shape: tuple, by_path: dict, longest: int) -> NamedSharding | None:
    if not shape:
        return None
    for n in range(min(len(path), longest), 0, -1):
        hit = by_path.get(path[-n:])
        if hit is not None and hit[0] == shape:
            return hit[1]
    return None


def from_host(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """The global array of ``sharding`` holding ``host``, a host array every process has whole: each process puts
    only its own devices' shards there (so it works on a multi-process mesh)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _identity(x):
    return x


@functools.lru_cache(maxsize=None)
def _resharder(sharding: jax.sharding.Sharding) -> Callable:
    """A jitted identity whose output has ``sharding`` (one compiled program per input sharding and shape)."""
    return jax.jit(_identity, out_shardings=sharding)


def reshard(tree: Any, shardings: Any) -> Any:
    """``tree``'s arrays placed as ``shardings`` (a tree of the same structure, e.g. from :func:`state_shardings`
    on another mesh), also onto other devices than they are on: a copy, leaf by leaf, device to device.

    On the same devices a leaf is resharded by a jitted identity with the target sharding: one collective program
    (``jax.device_put`` took 2.4 s to replicate a 1B model's FSDP shards over 4 GPUs). For other devices
    ``jax.device_put`` would go through host memory when a target block is not one of the source's blocks (a
    replicated target of an FSDP-sharded source), and across processes it needs the same device set. So an array
    bound for other devices is first replicated on its own mesh (an all-gather over the source devices' links;
    multi-process, every process must call this in the same order), then each target block is copied from a
    replica on a source device of its own process, the targets spread over those replicas so the copies use
    several links at once. One leaf at a time: the extra memory is one whole tensor per source device."""

    def one(x, sharding):
        if not isinstance(x, jax.Array) or x.sharding == sharding:
            return x
        if x.sharding.device_set == sharding.device_set:
            return _resharder(sharding)(x)
        if not isinstance(x.sharding, NamedSharding):
            return jax.device_put(x, sharding)
        if not x.is_fully_replicated:
            x = jax.device_put(x, NamedSharding(x.sharding.mesh, PartitionSpec()))
        replicas = [shard.data for shard in x.addressable_shards]
        blocks = [jax.device_put(replicas[i % len(replicas)][index], device)
                  for i, (device, index) in enumerate(sharding.addressable_devices_indices_map(x.shape).items())]
        return jax.make_array_from_single_device_arrays(x.shape, sharding, blocks)

    return jax.tree_util.tree_map(one, tree, shardings)


def to_host(x: Any) -> Any:
    """One (possibly sharded, possibly multi-host) ``jax.Array`` as a full host numpy array; other values
    pass through. Multi-host it is a collective (``process_allgather``): every process must call it."""
    if not isinstance(x, jax.Array):
        return x
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def on_host() -> contextlib.AbstractContextManager:
    """A context in which eager ``jnp`` math on host values (a step's masks, normalisers, advantages and
    schedule values, computed between its programs) runs on this process's CPU device: on an accelerator each
    small op would otherwise cost a dispatch, a synchronisation and a copy back, with the accelerator idle.
    Arrays committed to an accelerator stay where they are. Without a CPU backend (``JAX_PLATFORMS`` naming the
    accelerator only) it changes nothing."""
    try:
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return contextlib.nullcontext()
    return jax.default_device(cpu)


def iter_to_host(tree: Any) -> Iterator[tuple[str, Any]]:
    """Yield ``(path, numpy array)`` for every leaf of ``tree``, gathering one tensor at a time (host
    memory holds one full tensor, not the whole model). Multi-host: every process must iterate in
    the same order (it is a collective); each gets the full tensor."""
    for path, x in jax.tree_util.tree_leaves_with_path(_as_state(tree)):
        yield path_str(path), to_host(x)


def gather_to_host(tree: Any) -> Any:
    """``tree`` (a module's state, a State or a pytree) with every ``jax.Array`` replaced by the full
    numpy array, gathered tensor by tensor. Works multi-host (``process_allgather``; every process
    must call it and each receives the full values)."""
    return jax.tree_util.tree_map(to_host, _as_state(tree))


def host_copy(model: nnx.Module, only: Any = None) -> nnx.Module:
    """A copy of ``model`` whose variables (those of the ``nnx`` filter ``only``, default all) are full host numpy
    arrays, gathered tensor by tensor (:func:`gather_to_host`: multi-host a collective); the others stay as they
    are. What a weight sync keeps when the trainer may change or donate its arrays next."""
    if only is None:
        graphdef, state = nnx.split(model)
        return nnx.merge(graphdef, gather_to_host(state))
    graphdef, chosen, rest = nnx.split(model, only, ...)
    return nnx.merge(graphdef, gather_to_host(chosen), rest)


def check_placement(tree: Any, mesh: Mesh, rules: Rules | None = None) -> list[str]:
    """The guardrails of placing ``tree`` (a module, an abstract one from ``nnx.eval_shape`` too) on ``mesh``: a
    logical name the rules do not know is an error naming the parameters; a dimension its rule would shard but whose
    size does not divide the mesh axes stays replicated, and is named in one warning (once per mesh and rules) with
    the bytes per device that costs. Returns the warned lines."""
    rules = DEFAULT_RULES if rules is None else rules
    unknown = unknown_logical_axes(tree, rules)
    if unknown:
        names = sorted({a for axes in unknown.values() for a in axes if a is not None and a not in rules})
        raise ValueError(f"logical axis names {names} have no sharding rule (parameters {sorted(unknown)[:5]}); add "
                         "them to MeshConfig.rules, e.g. (('name', None),) to replicate them")
    lines, extra = [], 0
    for path, x in jax.tree_util.tree_leaves_with_path(_as_state(tree), is_leaf=_is_variable):
        axes = x.get_metadata().get("logical_axes") if _is_variable(x) else None
        if axes is None:
            continue
        value = _var_value(x)
        shape, itemsize = tuple(value.shape), np.dtype(value.dtype).itemsize
        undivided = undivided_dims(tuple(axes), mesh, rules, shape)
        if not undivided:
            continue
        spec = logical_to_spec(tuple(axes), mesh, rules, shape)
        per_device = int(np.prod(shape)) * itemsize // int(np.prod([mesh.shape[a] for p in spec for a in mesh_axes(p)]))
        for dim, name, wanted, size in undivided:
            kept = int(np.prod([mesh.shape[a] for a in mesh_axes(spec[dim])]))  # the axes the dimension did take
            extra += per_device - per_device // (size // kept)
            lines.append(f"{path_str(path)} dim {dim} ({name!r}, {shape[dim]}) over {'x'.join(wanted)}={size}")
    key = (tuple(mesh.shape.items()), tuple(sorted((k, str(v)) for k, v in rules.items())), tuple(lines))
    if lines and key not in _WARNED:
        _WARNED.add(key)
        logger.warning("%d parameter dimension(s) stay replicated because their size does not divide their mesh axes "
                       "(%.1f MiB more per device than sharded): %s%s; pad them or map their logical name elsewhere "
                       "in MeshConfig.rules", len(lines), extra / 2**20, "; ".join(lines[:4]),
                       f" and {len(lines) - 4} more" if len(lines) > 4 else "")
    return lines


_WARNED: set = set()


def unknown_logical_axes(tree: Any, rules: Rules | None = None) -> dict[str, tuple]:
    """``{path: logical_axes}`` of variables that use a logical name the rules do not know (such a
    dimension is silently replicated; usually a typo in a model)."""
    rules = DEFAULT_RULES if rules is None else rules
    out = {}
    for path, x in jax.tree_util.tree_leaves_with_path(_as_state(tree), is_leaf=_is_variable):
        if _is_variable(x):
            axes = x.get_metadata().get("logical_axes")
            if axes is not None and any(a is not None and a not in rules for a in axes):
                out[path_str(path)] = tuple(axes)
    return out
