"""LoRA adapters on the model's ``Linear`` layers (PEFT conventions, the PEFT adapter format).

:func:`apply_lora` replaces every targeted :class:`~jrl.models.layers.Linear` (HF module names:
``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``) by a
:class:`LoRALinear` that keeps the base ``kernel`` / ``bias`` variables under the same attribute
names (so parameter paths, sharding and the HF mapping do not change) and adds two
:class:`LoRAParam` variables:

- ``lora_a``: ``in_shape + (r,)``, PEFT's default init (uniform ±1/sqrt(fan_in), the bound of
  ``kaiming_uniform_(a=sqrt(5))``);
- ``lora_b``: ``(r,) + out_shape``, zeros, so a fresh adapter leaves the model unchanged.

On stacked layers (:func:`jrl.models.transformer.stack_layers`) the adapters are stacked the same way:
``lora_a`` ``(L,) + in_shape + (r,)`` and ``lora_b`` ``(L, r) + out_shape``.

The forward pass is ``y = x·W (+ b) + s · (x·A)·B`` with ``s = alpha / r`` or ``alpha / sqrt(r)``
(rsLoRA). In HF/PEFT terms ``lora_A.weight = A.reshape(in, r).T`` and ``lora_B.weight =
B.reshape(r, out).T``. Because the adapter variables have their own type, the trainable state is
``nnx.state(model, LoRAParam)`` and everything else stays frozen; :func:`lora_disabled` runs the
base model without a copy (reference log-probs), and :func:`merge_lora` folds ``W + s·A@B`` into a
plain :class:`~jrl.models.Transformer` for export.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jrl.models.layers import TRAINED, Linear
from jrl.models.transformer import Transformer, named_params

#: HF module names of the projections LoRA can target in every supported family.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAParam(nnx.Param):
    """A LoRA adapter matrix: trainable while the base ``nnx.Param`` weights stay frozen."""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the attention and MLP projections (PEFT ``LoraConfig`` names)."""

    rank: int = 8
    """r, the adapter rank."""
    alpha: float = 16.0
    """lora_alpha; the update is scaled by alpha / r (or alpha / sqrt(r) with rsLoRA)."""
    use_rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(r) instead of alpha / r."""
    target_modules: tuple[str, ...] = LORA_TARGETS
    """HF module names to adapt, any of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj."""

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraConfig.rank={self.rank!r} is invalid: use an int >= 1 (e.g. 8)")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha) \
                or self.alpha <= 0:
            raise ValueError(f"LoraConfig.alpha={self.alpha!r} is invalid: use a finite number > 0 (e.g. 2 * rank)")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        unknown = [t for t in self.target_modules if t not in LORA_TARGETS]
        if not self.target_modules or unknown:
            raise ValueError(
                f"LoraConfig.target_modules={self.target_modules!r} is invalid"
                + (f" (unknown: {unknown})" if unknown else " (empty)")
                + f": use a non-empty subset of {LORA_TARGETS}")

    @property
    def scale(self) -> float:
        """s = alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def _contract_trailing(x: jax.Array, w: jax.Array, n: int) -> jax.Array:
    """Contract the trailing ``n`` dims of x with the leading ``n`` dims of w."""
    return jax.lax.dot_general(x, w, ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))), ((), ())))


class LoRALinear(Linear):
    """A :class:`Linear` with a low-rank update ``s · (x·A)·B`` (same ``kernel`` / ``bias`` variables).

    ``stack``: the leading kernel dims beyond ``in_shape + out_shape`` (``(L,)`` on stacked layers, else ``()``),
    which the adapters share."""

    def __init__(self, base: Linear, *, rank: int, scale: float, key: jax.Array):
        self.in_shape, self.out_shape, self.dtype = base.in_shape, base.out_shape, base.dtype
        self.kernel, self.bias = base.kernel, base.bias
        kernel = base.kernel[...]
        axes = tuple(base.kernel.get_metadata().get("logical_axes") or (None,) * kernel.ndim)
        stack = self.stack
        lead, n_in = len(stack), len(stack) + len(self.in_shape)
        bound = 1.0 / math.sqrt(math.prod(self.in_shape))
        a = jax.random.uniform(key, stack + self.in_shape + (rank,), jnp.float32, -bound, bound).astype(kernel.dtype)
        self.lora_a = LoRAParam(a, logical_axes=axes[:n_in] + ("lora_rank",))
        self.lora_b = LoRAParam(jnp.zeros(stack + (rank,) + self.out_shape, kernel.dtype),
                                logical_axes=axes[:lead] + ("lora_rank",) + axes[n_in:])
        self.scale = float(scale)
        self.lora_enabled = True

    @property
    def stack(self) -> tuple[int, ...]:
        return tuple(self.kernel.shape[: self.kernel.ndim - len(self.in_shape) - len(self.out_shape)])

    def delta(self) -> jax.Array:
        """``s · A @ B`` in the kernel's layout ``in_shape + out_shape`` (float32; per layer when stacked)."""
        a = self.lora_a[...].astype(jnp.float32)
        b = self.lora_b[...].astype(jnp.float32)
        product = functools.partial(_contract_trailing, n=1)
        for _ in self.stack:
            product = jax.vmap(product)
        return self.scale * product(a, b)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = super().__call__(x)
        if not self.lora_enabled:
            return y
        xa = _contract_trailing(x.astype(self.dtype), self.lora_a[...].astype(self.dtype), len(self.in_shape))
        return y + (self.scale * _contract_trailing(xa, self.lora_b[...].astype(self.dtype), 1)).astype(y.dtype)


def _linear_slots(model: nnx.Module, targets: tuple[str, ...]):
    """(parent module, attribute name, path) of every Linear whose attribute name is in ``targets``."""
    out = []
    for path, node in nnx.iter_graph(model):
        if not path or not isinstance(node, Linear) or path[-1] not in targets:
            continue
        parent = model
        for p in path[:-1]:
            parent = parent[p] if isinstance(p, int) else getattr(parent, p)
        out.append((parent, path[-1], ".".join(str(p) for p in path)))
    return out


def apply_lora(model: Transformer, config: LoraConfig, *, seed: int = 0) -> Transformer:
    """Wrap the targeted Linear layers of ``model`` in :class:`LoRALinear`, in place; returns ``model``.

    Adapter A matrices are drawn from ``seed`` (one fold per layer, in graph order), B is zero. With a
    mesh on the model, place the new variables with :func:`jrl.sharding.shard_model` afterwards.
    """
    slots = _linear_slots(model, config.target_modules)
    if not slots:
        raise ValueError(
            f"LoraConfig.target_modules={config.target_modules!r} matched no Linear layer of this "
            f"{model.config.model_type} model; use names from {LORA_TARGETS}")
    if any(isinstance(parent.__dict__.get(name), LoRALinear) for parent, name, _ in slots):
        raise ValueError("apply_lora: the model already has LoRA adapters")
    key = jax.random.key(seed)
    for i, (parent, name, _) in enumerate(slots):
        base = getattr(parent, name)
        setattr(parent, name, LoRALinear(base, rank=config.rank, scale=config.scale, key=jax.random.fold_in(key, i)))
    return model


def lora_layers(model: nnx.Module) -> dict[str, LoRALinear]:
    """``{"layers.0.attn.q_proj": LoRALinear, ...}`` for every adapted layer of ``model``."""
    return {".".join(str(p) for p in path): node for path, node in nnx.iter_graph(model)
            if isinstance(node, LoRALinear)}


def has_lora(model: nnx.Module) -> bool:
    return bool(lora_layers(model))


def trainable_params(model: nnx.Module):
    """The ``nnx`` filter of what training updates in ``model``: its LoRA adapters when it has them, else every
    parameter but the frozen ones (:data:`jrl.models.layers.TRAINED`)."""
    return LoRAParam if has_lora(model) else TRAINED


@contextlib.contextmanager
def lora_disabled(model: nnx.Module):
    """Run ``model`` as its base weights (adapters switched off) inside the ``with`` block, no copy."""
    layers = list(lora_layers(model).values())
    for layer in layers:
        layer.lora_enabled = False
    try:
        yield model
    finally:
        for layer in layers:
            layer.lora_enabled = True


def merge_lora(model: Transformer) -> Transformer:
    """A plain :class:`Transformer` whose kernels are ``W + s·A@B`` (computed in float32, cast back to the
    kernel dtype); every other parameter is shared with ``model``. ``model`` is not changed."""
    layers = lora_layers(model)
    deltas = {f"{path}.kernel": layer.delta() for path, layer in layers.items()}
    rules = None if model.rules is None else dict(model.rules)
    plain = nnx.eval_shape(lambda: Transformer(model.config, rngs=nnx.Rngs(0), mesh=model.mesh, rules=rules))
    plain.source_dir = model.source_dir
    src = named_params(model)
    for path, var in named_params(plain).items():
        value = src[path][...]
        if path in deltas:
            value = (value.astype(jnp.float32) + deltas.pop(path)).astype(value.dtype)
        var.set_value(value)
    if deltas:
        raise ValueError(f"merge_lora: adapters on {sorted(deltas)} have no matching base kernel")
    return plain


def decoding_view(model: Transformer) -> Transformer:
    """The model a sampler decodes with: layers unstacked (:meth:`Transformer.unstacked`) and, when its LoRA
    adapters are on, the adapters merged into a copy of their kernels (:func:`merge_lora`), so a decode step
    runs one matmul per projection with or without adapters. Built inside the sampler's jit, once per
    generation: one copy of the layer weights (the unstacked view is one already)."""
    view = model.unstacked()
    adapters = lora_layers(view).values()
    if adapters and all(layer.lora_enabled for layer in adapters):
        return merge_lora(view)
    return view
