"""The jitted programs of a learner's update (:class:`jrl.train.learner.Learner`), and the pytree forms they take
and return the learner's state in (:class:`Flat`, :class:`Scalars`, :class:`Static`).

Two ways to accumulate the gradients of an update's micro-batches on a mesh (``OptimConfig.grad_sync``):

- per micro-batch (:func:`micro_step`): each micro-batch's gradient is reduced over the devices into an accumulator
  laid out as the parameters (FSDP: every micro-batch gathers each layer's weights, forward and backward, and
  reduce-scatters its gradient);
- per update (:func:`local_micro_step`): the weights are gathered whole once (:func:`gathered`), each device runs
  the one-device program on its rows of every micro-batch and adds its gradient to its own slice of an
  accumulator with a leading device axis (:func:`local_accumulator`), and :func:`reduce_and_apply` sums the
  slices into the parameters' layout (one reduce-scatter) before the optimizer update. No collective runs between
  micro-batches, at the memory of the whole weights and a whole gradient per device (ZeRO-2 with the weights
  kept gathered over the update). The loss must be a sum over rows (each device sees only its own): see
  :mod:`jrl.train.grad_sync`. An update of one micro-batch runs it as one program (:func:`local_step_and_apply`):
  one all-gather of the weights, the one-device program, one reduce-scatter.
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jrl.models import router_stats
from jrl.models.lora import lora_disabled
from jrl.sharding import unpack


class Static:
    """A static argument of the step's programs whose hash is computed once: ``jax.jit`` hashes its static
    arguments on every call, and hashing the graph definition of a model with unrolled layers walks every
    node (milliseconds per call with the accelerator idle)."""

    __slots__ = ("value", "_hash")

    def __init__(self, value):
        self.value, self._hash = value, hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, Static) and self._hash == other._hash and self.value == other.value)


@jax.tree_util.register_pytree_node_class
class Flat:
    """A pytree held as its leaves and its structure (hashed once). The step's programs take and return the
    learner's parameters, frozen weights and optimizer state in this form: ``jax.jit`` then flattens each with
    one call instead of walking every nested module state, on the host's clock with the accelerator waiting
    (a 1B model's parameters and optimizer state, on a CPU: 0.1 ms to flatten and 0.13 ms to rebuild with scanned
    layers, 0.6 and 1.5 ms unrolled)."""

    __slots__ = ("structure", "leaves")

    def __init__(self, structure: Static, leaves: tuple):
        self.structure, self.leaves = structure, tuple(leaves)

    @classmethod
    def of(cls, tree) -> Flat:
        leaves, treedef = jax.tree.flatten(tree)
        return cls(Static(treedef), leaves)

    @property
    def tree(self):
        """The pytree itself."""
        return jax.tree.unflatten(self.structure.value, self.leaves)

    def like(self, tree) -> Flat:
        """``tree`` (of this structure, e.g. its gradient or its update) in this form."""
        return Flat(self.structure, jax.tree.leaves(tree))

    def tree_flatten(self):
        return self.leaves, self.structure

    @classmethod
    def tree_unflatten(cls, structure, leaves):
        return cls(structure, leaves)


@jax.tree_util.register_pytree_node_class
class Scalars:
    """Named scalars of one program as one float32 vector, so the host fetches them in one copy. The names are
    static pytree data: they leave the program with the vector."""

    __slots__ = ("names", "values")

    def __init__(self, names: tuple[str, ...], values):
        self.names, self.values = names, values

    @classmethod
    def of(cls, named: dict) -> Scalars:
        """Pack ``{name: scalar}`` (inside a traced program: one stack, no extra dispatch)."""
        return cls(tuple(named), jnp.stack([jnp.asarray(v, jnp.float32).reshape(()) for v in named.values()]))

    def tree_flatten(self):
        return (self.values,), self.names

    @classmethod
    def tree_unflatten(cls, names, children):
        return cls(names, *children)


def grads_of(params, frozen, rows, aux, graphdef, loss, router, micro_batches):
    """(loss, metrics), ∇ loss of one micro-batch. A MoE model's router statistics join the metrics
    (:func:`jrl.models.router_stats.summary`) and, weighted by ``router`` = (aux-loss coefficient, z-loss
    coefficient) over ``micro_batches`` (the update's count: a traced value, so that an update skipping a different
    number of micro-batches runs the same program), its loss."""
    aux_coef, z_coef = router

    def f(p):
        with router_stats.collecting() as stats:
            value, metrics = loss(nnx.merge(graphdef.value, p, frozen), rows, aux)
        if not stats:
            return value, metrics
        terms = router_stats.summary(stats)
        value = value + (aux_coef * terms["moe/aux_loss"] + z_coef * terms["moe/router_z_loss"]) / micro_batches
        return value, {**metrics, **terms}

    return jax.value_and_grad(f, has_aux=True)(params)


def optimizer_update(params, opt_state, grads, tx):
    """One optimizer update; also returns the gradient's global norm."""
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)


def _applied(params: Flat, opt_state: Flat, grads, tx):
    """:func:`optimizer_update` on the learner's :class:`Flat` trees (``grads`` a plain tree): the new params and
    state as :class:`Flat`, and the global norm as :class:`Scalars`."""
    new_params, new_state, gnorm = optimizer_update(params.tree, opt_state.tree, grads, tx)
    return params.like(new_params), opt_state.like(new_state), Scalars.of({"grad_norm": gnorm})


# The programs below take and return the learner's trees as :class:`Flat`.
def respelled(tree):
    """``tree``'s arrays with their shardings spelled as a program's output spells them (a :class:`NamedSharding`'s
    spec without trailing Nones), rewrapped without a copy. The parameters and the optimizer state come back from
    the first optimizer update spelled so; had they been spelled otherwise before it, every program taking them
    would compile again."""
    def one(x):
        if not isinstance(x, jax.Array) or not isinstance(x.sharding, NamedSharding):
            return x
        spec = list(x.sharding.spec)
        while spec and spec[-1] is None:
            spec.pop()
        sharding = NamedSharding(x.sharding.mesh, PartitionSpec(*spec), memory_kind=x.sharding.memory_kind)
        if sharding == x.sharding:
            return x
        return jax.make_array_from_single_device_arrays(x.shape, sharding, [s.data for s in x.addressable_shards])

    return jax.tree.map(one, tree)


def laid_out(tree: Flat, layout: Static | None) -> Flat:
    """``tree`` held with ``layout`` (its leaves' shardings; None: as the compiler picks). A gradient accumulator
    needs it: zeros and sums have no sharding of their own, and XLA put a whole accumulator on the first device and
    returned parts of it replicated."""
    if layout is None:
        return tree
    return Flat(tree.structure, [jax.lax.with_sharding_constraint(x, s)
                                 for x, s in zip(tree.leaves, layout.value, strict=True)])


@functools.partial(jax.jit, static_argnames=("graphdef", "loss", "router", "layout"), donate_argnums=0)
def micro_step(acc: Flat, params: Flat, frozen: Flat, rows, aux, micro_batches, *, graphdef, loss, router, layout):
    """``acc + ∇ loss`` of one micro-batch (the accumulator is donated; laid out as ``layout``), its loss and
    metrics."""
    (value, metrics), grads = grads_of(params.tree, frozen.tree, unpack(rows), unpack(aux), graphdef, loss, router,
                                     micro_batches)
    return (laid_out(jax.tree.map(jnp.add, acc, params.like(grads)), layout),
            Scalars.of({"loss": value, **metrics}))


@functools.partial(jax.jit, static_argnames=("graphdef", "loss", "tx", "router"), donate_argnums=(0, 1))
def micro_step_and_apply(params: Flat, opt_state: Flat, frozen: Flat, batch, *, graphdef, loss, tx, router):
    """A whole update of one micro-batch (``batch``: its rows and aux, see :meth:`Learner._put_micro_batch`) in one
    program: no accumulator, params and state donated."""
    rows, aux = unpack(batch)
    (value, metrics), grads = grads_of(params.tree, frozen.tree, rows, aux, graphdef, loss, router, 1)
    new_params, new_state, gnorm = optimizer_update(params.tree, opt_state.tree, grads, tx)
    return params.like(new_params), opt_state.like(new_state), Scalars.of({"loss": value, **metrics,
                                                                           "grad_norm": gnorm})


@functools.partial(jax.jit, static_argnames=("graphdef", "fn", "disable_lora"))
def evaluate(params: Flat, frozen: Flat, rows, aux, *, graphdef, fn, disable_lora):
    rows, aux = unpack(rows), unpack(aux)
    model = nnx.merge(graphdef.value, params.tree, frozen.tree)
    with lora_disabled(model) if disable_lora else contextlib.nullcontext():
        return fn(model, rows, aux)


@functools.partial(jax.jit, static_argnames=("tx",), donate_argnums=(0, 1))
def apply_update(params: Flat, opt_state: Flat, grads: Flat, *, tx):
    """One optimizer update (params and optimizer state donated); returns the gradient's global norm too."""
    return _applied(params, opt_state, grads.tree, tx)


@functools.partial(jax.jit, static_argnames=("layout",))
def zeros_like(tree: Flat, *, layout: Static | None) -> Flat:
    return laid_out(jax.tree.map(jnp.zeros_like, tree), layout)


copy_tree = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


@functools.partial(jax.jit, static_argnames=("mesh",))
def gathered(tree: Flat, *, mesh: Mesh) -> Flat:
    """A whole copy of ``tree``'s arrays on every device of ``mesh`` (one all-gather program)."""
    everywhere = NamedSharding(mesh, PartitionSpec())
    return Flat(tree.structure, [jax.lax.with_sharding_constraint(x, everywhere) for x in tree.leaves])


def _devices(mesh: Mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


@functools.partial(jax.jit, static_argnames=("mesh", "axes"))
def local_accumulator(params: Flat, *, mesh: Mesh, axes: tuple[str, ...]) -> Flat:
    """Zeros [d, *shape] for each parameter, split over the d devices of the batch ``axes``: each device's own
    whole gradient sum."""
    split = NamedSharding(mesh, PartitionSpec(axes))
    d = _devices(mesh, axes)
    return Flat(params.structure, [jax.lax.with_sharding_constraint(jnp.zeros((d,) + x.shape, x.dtype), split)
                                   for x in params.leaves])


def _per_device_grads(graphdef, loss, router, mesh: Mesh, axes: tuple[str, ...]):
    """The ``shard_map`` of each device's gradient of its rows of one micro-batch, whole weights on every device
    (``graphdef`` a model without a mesh: the one-device program): ``(params, frozen, rows, aux, micro_batches) ->
    (gradient, per-device scalars)``. The gradient has a leading device axis split over the batch ``axes``; each
    device's loss and metrics are one row of the :class:`Scalars` [d, k], on a mesh of several processes gathered
    onto every device, so that each process can read them all."""
    split, everywhere = PartitionSpec(axes), PartitionSpec()
    gather_metrics = jax.process_count() > 1

    def per_device(params, frozen, rows, aux, micro_batches):
        (value, metrics), grads = grads_of(params.tree, frozen.tree, rows, aux, graphdef, loss, router, micro_batches)
        scalars = Scalars.of({"loss": value, **metrics})
        values = jax.lax.all_gather(scalars.values, axes) if gather_metrics else scalars.values[None]
        return params.like(jax.tree.map(lambda g: g[None], grads)), Scalars(scalars.names, values)

    return jax.shard_map(per_device, mesh=mesh, check_vma=False,
                         in_specs=(everywhere, everywhere, split, everywhere, everywhere),
                         out_specs=(split, everywhere if gather_metrics else split))


@functools.partial(jax.jit, static_argnames=("graphdef", "loss", "router", "mesh", "axes"), donate_argnums=0)
def local_micro_step(acc: Flat, params: Flat, frozen: Flat, rows, aux, micro_batches, *, graphdef, loss, router,
                     mesh: Mesh, axes: tuple[str, ...]):
    """Each device's gradient of its rows of one micro-batch added to its slice of ``acc`` (donated), with whole
    ``params`` and ``frozen`` on every device (:func:`_per_device_grads`); each device's loss and metrics as one
    row of the returned :class:`Scalars` [d, k]."""
    grads, part = _per_device_grads(graphdef, loss, router, mesh, axes)(params, frozen, unpack(rows), unpack(aux),
                                                                        micro_batches)
    return jax.tree.map(jnp.add, acc, grads), part


def _summed(acc: Flat, layout: Static, reduce_dtype: str | None) -> Flat:
    """The devices' gradients of ``acc`` (a leading device axis) added up into the parameters' ``layout``: one
    reduce-scatter per array, in ``reduce_dtype`` (None: the gradient's own; ``ModelConfig.grad_reduce_dtype``).
    ``jax.lax.reduce`` rather than ``sum``, which adds bfloat16 in float32 and so moved twice the bytes."""
    def one(x):
        y = x if reduce_dtype is None else x.astype(reduce_dtype)
        return jax.lax.reduce(y, jnp.zeros((), y.dtype), jax.lax.add, (0,)).astype(x.dtype)

    return laid_out(Flat(acc.structure, [one(x) for x in acc.leaves]), layout)


@functools.partial(jax.jit, static_argnames=("tx", "layout", "reduce_dtype"), donate_argnums=(0, 1))
def reduce_and_apply(params: Flat, opt_state: Flat, acc: Flat, *, tx, layout: Static, reduce_dtype: str | None):
    """The devices' gradient sums of ``acc`` (:func:`local_accumulator`) added up into the parameters' ``layout``
    (one reduce-scatter per array, :func:`_summed`), then one optimizer update (params and state donated); the
    global norm too."""
    return _applied(params, opt_state, _summed(acc, layout, reduce_dtype).tree, tx)


@functools.partial(jax.jit, static_argnames=("graphdef", "loss", "tx", "router", "mesh", "axes", "layout",
                                            "reduce_dtype"), donate_argnums=(0, 1))
def local_step_and_apply(params: Flat, opt_state: Flat, frozen: Flat, batch, *, graphdef, loss, tx, router,
                         mesh: Mesh, axes: tuple[str, ...], layout: Static, reduce_dtype: str | None):
    """A whole update of one micro-batch accumulated per device, in one program: the weights gathered whole, each
    device's gradient of its rows (:func:`_per_device_grads`), one reduce-scatter into the parameters' ``layout``
    (:func:`_summed`), one optimizer update (params and state donated). Returns the per-device loss and metrics
    [d, k] and the gradient's global norm."""
    rows, aux = unpack(batch)
    fn = _per_device_grads(graphdef, loss, router, mesh, axes)
    grads, part = fn(gathered(params, mesh=mesh), gathered(frozen, mesh=mesh), rows, aux, jnp.int32(1))
    new_params, new_state, gnorm = _applied(params, opt_state, _summed(grads, layout, reduce_dtype).tree, tx)
    return new_params, new_state, part, gnorm
