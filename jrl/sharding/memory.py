"""How many bytes of parameters, gradients and optimizer state each device holds, before allocating.

:func:`memory_report` works from shapes and rule shardings only, so it runs on an abstract model
(``nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))``) for a pod-sized config on a laptop.
:func:`device_bytes` measures the same quantity on real placed arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jrl.sharding.placement import _as_state, opt_state_shardings, state_shardings
from jrl.sharding.rules import MeshAxes


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes per device (the largest over devices) and in total (one copy), from shapes + shardings."""

    num_devices: int
    mesh_shape: dict[str, int]
    param_count: int
    param_bytes: int
    param_bytes_per_device: int
    trainable_count: int
    grad_bytes_per_device: int
    """Gradients of the trainable parameters, sharded like them (a train step holds one copy)."""
    opt_state_bytes: int
    opt_state_bytes_per_device: int
    replicated_param_bytes: int
    """Bytes of parameters that no rule shards on this mesh (held whole by every device)."""

    @property
    def total_bytes_per_device(self) -> int:
        """Parameters + gradients + optimizer state per device (activations not included)."""
        return self.param_bytes_per_device + self.grad_bytes_per_device + self.opt_state_bytes_per_device

    def __str__(self) -> str:
        mesh = ", ".join(f"{k}={v}" for k, v in self.mesh_shape.items())
        rows = [
            f"mesh ({mesh}), {self.num_devices} devices",
            f"  parameters   {self.param_count:>14,d}  total {_fmt(self.param_bytes):>11}"
            f"  per device {_fmt(self.param_bytes_per_device):>11}",
            f"  gradients    {self.trainable_count:>14,d}  {'':>17}  per device {_fmt(self.grad_bytes_per_device):>11}",
            f"  optimizer    {'':>14}  total {_fmt(self.opt_state_bytes):>11}"
            f"  per device {_fmt(self.opt_state_bytes_per_device):>11}",
            f"  sum per device (no activations): {_fmt(self.total_bytes_per_device)}",
        ]
        if self.replicated_param_bytes:
            rows.append(f"  (replicated parameters: {_fmt(self.replicated_param_bytes)} on every device)")
        return "\n".join(rows)


def _itemsize(dtype: Any) -> int:
    try:
        return np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes (PRNG keys)
        return int(getattr(dtype, "itemsize", 8))


def _nbytes(x: Any) -> int:
    return int(np.prod(x.shape, dtype=np.int64)) * _itemsize(x.dtype)


def _shard_bytes(shape: tuple, dtype: Any, sharding: NamedSharding) -> int:
    return int(np.prod(sharding.shard_shape(shape), dtype=np.int64)) * _itemsize(dtype)


def _pairs(tree: Any, shardings: Any) -> list[tuple[Any, NamedSharding]]:
    leaves = jax.tree_util.tree_leaves(tree)
    shs = jax.tree_util.tree_leaves(shardings, is_leaf=lambda s: isinstance(s, NamedSharding))
    assert len(leaves) == len(shs), (len(leaves), len(shs))
    return list(zip(leaves, shs, strict=True))


def _make_tx(optimizer: Any):
    if optimizer is None:
        return None
    if isinstance(optimizer, str):
        import optax

        factory = getattr(optax, optimizer, None)
        if factory is None:
            raise ValueError(f"memory_report: optimizer={optimizer!r} is not an optax function (e.g. 'adamw', 'sgd')")
        return factory(1e-3)
    return optimizer


def memory_report(
    model_or_abstract_state: Any,
    mesh: Mesh,
    rules: Mapping[str, MeshAxes] | None = None,
    optimizer: Any = "adamw",
    wrt: Any = nnx.Param,
) -> MemoryReport:
    """Per-device and total bytes of parameters, gradients and optimizer state on ``mesh``.

    ``model_or_abstract_state``: an ``nnx.Module`` (concrete or from ``nnx.eval_shape``: nothing is
    allocated) or an ``nnx.State``. ``optimizer``: an optax ``GradientTransformation``, the name of
    an optax optimizer (``"adamw"``, ``"sgd"``, ...) or ``None``; its state is computed with
    ``jax.eval_shape`` on the ``wrt`` parameters (default all ``nnx.Param``; ``nnx.LoRAParam`` for
    LoRA) and sharded like them."""
    if isinstance(model_or_abstract_state, nnx.Module):
        params = nnx.state(model_or_abstract_state, nnx.Param)
        trainable = nnx.state(model_or_abstract_state, wrt)
    else:
        params = trainable = _as_state(model_or_abstract_state)
        if isinstance(params, nnx.State) and wrt is not nnx.Param:
            trainable = params.filter(wrt)
    abstract = lambda t: jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), t)  # noqa: E731
    params, trainable = abstract(params), abstract(trainable)

    p_pairs = _pairs(params, state_shardings(params, mesh, rules))
    param_bytes = sum(_nbytes(x) for x, _ in p_pairs)
    param_dev = sum(_shard_bytes(x.shape, x.dtype, s) for x, s in p_pairs)
    replicated = sum(_nbytes(x) for x, s in p_pairs if s.is_fully_replicated and mesh.size > 1)
    t_shardings = state_shardings(trainable, mesh, rules)
    t_pairs = _pairs(trainable, t_shardings)
    grad_dev = sum(_shard_bytes(x.shape, x.dtype, s) for x, s in t_pairs)

    opt_bytes = opt_dev = 0
    tx = _make_tx(optimizer)
    if tx is not None:
        opt_state = jax.eval_shape(tx.init, trainable)
        o_pairs = _pairs(opt_state, opt_state_shardings(opt_state, trainable, mesh, rules, t_shardings))
        opt_bytes = sum(_nbytes(x) for x, _ in o_pairs)
        opt_dev = sum(_shard_bytes(x.shape, x.dtype, s) for x, s in o_pairs)

    return MemoryReport(
        num_devices=mesh.size,
        mesh_shape=dict(mesh.shape),
        param_count=sum(int(np.prod(x.shape, dtype=np.int64)) for x, _ in p_pairs),
        param_bytes=param_bytes,
        param_bytes_per_device=param_dev,
        trainable_count=sum(int(np.prod(x.shape, dtype=np.int64)) for x, _ in t_pairs),
        grad_bytes_per_device=grad_dev,
        opt_state_bytes=opt_bytes,
        opt_state_bytes_per_device=opt_dev,
        replicated_param_bytes=replicated,
    )


def device_bytes(tree: Any) -> dict[Any, int]:
    """Measured: for every device, the bytes of the addressable shards of ``tree``'s arrays that live
    on it (placed ``jax.Array`` s; a module is read through ``nnx.state``)."""
    out: dict[Any, int] = {}
    for x in jax.tree_util.tree_leaves(_as_state(tree)):
        if isinstance(x, jax.Array):
            for shard in x.addressable_shards:
                out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


def memory_limit(device) -> int | None:
    """Bytes of memory ``device`` has for arrays (its allocator's limit); None where it does not say (CPU devices)."""
    return (device.memory_stats() or {}).get("bytes_limit")
