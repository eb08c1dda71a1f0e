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

On MoE layers ``LoraConfig.target_parameters`` (PEFT's names) adds adapters to the router (a
:class:`LoRALinear` on ``router``) and to the stacked expert weights (:class:`ExpertsLoRA`, one A/B pair per
expert, run by :func:`jrl.kernels.moe.gmm_lora`).

The forward pass is ``y = x·W (+ b) + s · (x·A)·B`` with ``s = alpha / r`` or ``alpha / sqrt(r)``
(rsLoRA). In HF/PEFT terms ``lora_A.weight = A.reshape(in, r).T`` and ``lora_B.weight =
B.reshape(r, out).T``. Because the adapter variables have their own type, the trainable state is
``nnx.state(model, LoRAParam)`` and everything else stays frozen; :func:`lora_disabled` runs the
base model without a copy (reference log-probs), and :func:`merge_lora` folds ``W + s·A@B`` (experts
included) into a plain :class:`~jrl.models.Transformer` for export.
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jrl.kernels.moe import gmm, gmm_lora, swiglu
from jrl.models.layers import TRAINED, Linear
from jrl.models.moe import Experts
from jrl.models.transformer import Transformer, named_params
from jrl.models.lora_config import LORA_TARGETS, MOE_LORA_TARGETS, LoraConfig  # noqa: F401 (public names)


class LoRAParam(nnx.Param):
    """A LoRA adapter matrix: trainable while the base ``nnx.Param`` weights stay frozen."""


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

    @property
    def rank(self) -> int:
        return self.lora_a.shape[-1]

    def deltas(self) -> dict[str, jax.Array]:
        """``{"kernel": s · A @ B}`` (see :meth:`delta`)."""
        return {"kernel": self.delta()}

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


class ExpertsLoRA(Experts):
    """:class:`~jrl.models.moe.Experts` with a low-rank update per expert on the stacked weights (PEFT's
    ``ParamWrapper`` on transformers' fused expert parameters; same ``gate_proj`` / ``up_proj`` / ``down_proj``
    variables). Targets (``gate_up``, ``down``) and their :class:`LoRAParam` variables, per expert ``e``:

    - ``gate_up``: ``lora_gate_up_a`` ``[E, H, r]``, one A for both projections as transformers fuses them into
      ``gate_up_proj``, and ``lora_gate_b`` / ``lora_up_b`` ``[E, r, I]`` (the two halves of its B);
    - ``down``: ``lora_down_a`` ``[E, I, r]`` and ``lora_down_b`` ``[E, r, H]``.

    An untargeted pair is ``None``. Stacked layers add a leading layer axis to every adapter. The grouped matmuls
    run as :func:`jrl.kernels.moe.gmm_lora` (``x W + s (x A) B`` per expert, no ``[E, H, I]`` delta built)."""

    def __init__(self, base: Experts, *, gate_up: bool, down: bool, rank: int, scale: float, key: jax.Array):
        self.dtype = base.dtype
        self.gate_proj, self.up_proj, self.down_proj = base.gate_proj, base.up_proj, base.down_proj
        self.rank, self.scale, self.lora_enabled = int(rank), float(scale), True
        k_gate_up, k_down = jax.random.split(key)
        gate_up_a, (gate_b, up_b) = self._pair(base.gate_proj, k_gate_up, 2) if gate_up else (None, (None, None))
        down_a, (down_b,) = self._pair(base.down_proj, k_down, 1) if down else (None, (None,))
        self.lora_gate_up_a, self.lora_gate_b, self.lora_up_b = nnx.data(gate_up_a), nnx.data(gate_b), nnx.data(up_b)
        self.lora_down_a, self.lora_down_b = nnx.data(down_a), nnx.data(down_b)

    def _pair(self, weight: nnx.Param, key: jax.Array, n_b: int) -> tuple[LoRAParam, tuple[LoRAParam, ...]]:
        """A ``[..., E, in, r]`` (PEFT's init, uniform ±1/sqrt(in)) and ``n_b`` zero Bs ``[..., E, r, out]`` for the
        expert weight ``[..., E, in, out]``."""
        w = weight[...]
        axes = tuple(weight.get_metadata().get("logical_axes") or (None,) * w.ndim)
        bound = 1.0 / math.sqrt(w.shape[-2])
        a = jax.random.uniform(key, w.shape[:-1] + (self.rank,), jnp.float32, -bound, bound).astype(w.dtype)
        b_axes = axes[:-2] + ("lora_rank", axes[-1])
        return (LoRAParam(a, logical_axes=axes[:-1] + ("lora_rank",)),
                tuple(LoRAParam(jnp.zeros(w.shape[:-2] + (self.rank, w.shape[-1]), w.dtype), logical_axes=b_axes)
                      for _ in range(n_b)))

    def _adapters(self) -> tuple[LoRAParam, ...]:
        return tuple(v for v in (self.lora_gate_up_a, self.lora_gate_b, self.lora_up_b, self.lora_down_a,
                                 self.lora_down_b) if v is not None)

    def arrays(self):
        """The base weights then, with the adapters on, the targeted adapters (compute dtype, logical axes)."""
        base, axes = super().arrays()
        if not self.lora_enabled:
            return base, axes
        adapters = self._adapters()
        # Called per layer (inside the layer scan the metadata still names the stacked layer axis): the last 3 axes.
        return (base + tuple(v[...].astype(self.dtype) for v in adapters),
                axes + tuple(tuple(v.get_metadata()["logical_axes"])[-3:] for v in adapters))

    def compute(self, rows: jax.Array, group_sizes: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
                *adapters: jax.Array, rows_in_use: jax.Array | None = None) -> jax.Array:
        if not adapters:
            return super().compute(rows, group_sizes, gate, up, down, rows_in_use=rows_in_use)
        it = iter(adapters)
        fill = dict(fill_past_groups=rows_in_use is None)  # as Experts.compute
        if self.lora_gate_up_a is not None:
            a, b_gate, b_up = next(it), next(it), next(it)
            h = swiglu(gmm_lora(rows, gate, a, b_gate, self.scale, group_sizes, **fill),
                       gmm_lora(rows, up, a, b_up, self.scale, group_sizes, **fill), rows_in_use)
        else:
            h = swiglu(gmm(rows, gate, group_sizes, **fill), gmm(rows, up, group_sizes, **fill), rows_in_use)
        if self.lora_down_a is not None:
            return gmm_lora(h, down, next(it), next(it), self.scale, group_sizes, **fill)
        return gmm(h, down, group_sizes, **fill)

    def over(self, base: Experts) -> ExpertsLoRA:
        """These adapters (their arrays, no copy) on ``base``'s expert weights."""
        view = nnx.merge(*nnx.split(self))
        view.gate_proj, view.up_proj, view.down_proj = base.gate_proj, base.up_proj, base.down_proj
        return view

    def deltas(self) -> dict[str, jax.Array]:
        """``{weight name: s · A_e @ B_e}`` of each adapted expert weight, in its layout (float32)."""
        def product(a, b):
            return self.scale * jnp.einsum("...ir,...ro->...io", a[...].astype(jnp.float32), b[...].astype(jnp.float32))
        out = {}
        if self.lora_gate_up_a is not None:
            out["gate_proj"] = product(self.lora_gate_up_a, self.lora_gate_b)
            out["up_proj"] = product(self.lora_gate_up_a, self.lora_up_b)
        if self.lora_down_a is not None:
            out["down_proj"] = product(self.lora_down_a, self.lora_down_b)
        return out


def _slots(model: nnx.Module, kind: type, names: tuple[str, ...] | None = None):
    """(parent module, attribute name, path) of every ``kind`` node of ``model`` (whose attribute name is in
    ``names``)."""
    out = []
    for path, node in nnx.iter_graph(model):
        if not path or not isinstance(node, kind) or (names is not None and path[-1] not in names):
            continue
        parent = model
        for p in path[:-1]:
            parent = parent[p] if isinstance(p, int) else getattr(parent, p)
        out.append((parent, path[-1], ".".join(str(p) for p in path)))
    return out


def apply_lora(model: Transformer, config: LoraConfig, *, seed: int = 0) -> Transformer:
    """Add the adapters ``config`` asks for to ``model``, in place; returns ``model``: every targeted Linear layer
    (``target_modules``, and the MoE routers for ``mlp.gate.weight``) becomes a :class:`LoRALinear`, and the MoE
    experts an :class:`ExpertsLoRA` when ``target_parameters`` names their weights.

    Adapter A matrices are drawn from ``seed`` (one fold per adapted module: the Linear targets in graph order,
    then the routers, then the experts), B is zero. With a mesh on the model, place the new variables with
    :func:`jrl.sharding.shard_model` afterwards.
    """
    if lora_layers(model):
        raise ValueError("apply_lora: the model already has LoRA adapters")
    params = config.target_parameters
    gate_up, down = "mlp.experts.gate_up_proj" in params, "mlp.experts.down_proj" in params
    linear = _slots(model, Linear, config.target_modules) if config.target_modules else []
    routers = _slots(model, Linear, ("router",)) if "mlp.gate.weight" in params else []
    experts = _slots(model, Experts) if gate_up or down else []
    if params and not _slots(model, Experts):
        raise ValueError(f"LoraConfig.target_parameters={params!r} names MoE parameters, but this "
                         f"{model.config.model_type} model has no MoE layers; leave target_parameters empty")
    if not linear and not routers and not experts:
        raise ValueError(
            f"LoraConfig.target_modules={config.target_modules!r} matched no Linear layer of this "
            f"{model.config.model_type} model; use names from {LORA_TARGETS}")
    key = jax.random.key(seed)
    for i, (parent, name, _) in enumerate(linear + routers + experts):
        base, k = getattr(parent, name), jax.random.fold_in(key, i)
        if isinstance(base, Experts):
            adapted = ExpertsLoRA(base, gate_up=gate_up, down=down, rank=config.rank, scale=config.scale, key=k)
        else:
            adapted = LoRALinear(base, rank=config.rank, scale=config.scale, key=k)
        setattr(parent, name, adapted)
    return model


def lora_layers(model: nnx.Module) -> dict[str, LoRALinear | ExpertsLoRA]:
    """``{"layers.0.attn.q_proj": LoRALinear, "layers.0.mlp.experts": ExpertsLoRA, ...}``: every adapted module of
    ``model``."""
    return {".".join(str(p) for p in path): node for path, node in nnx.iter_graph(model)
            if isinstance(node, (LoRALinear, ExpertsLoRA))}


def has_lora(model: nnx.Module) -> bool:
    return bool(lora_layers(model))


def has_moe_lora(model: nnx.Module) -> bool:
    """Whether ``model`` has adapters on MoE parameters (experts or routers: ``LoraConfig.target_parameters``)."""
    return any(isinstance(layer, ExpertsLoRA) or path.endswith(".router") for path, layer in lora_layers(model).items())


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


def merge_lora(model: Transformer, *, experts: bool = True) -> Transformer:
    """A plain :class:`Transformer` whose adapted weights (Linear kernels, expert weights) are ``W + s·A@B``
    (computed in float32, cast back to the weight's dtype); every other parameter is shared with ``model``.
    With ``experts=False`` the expert adapters stay unmerged: the result's experts are :class:`ExpertsLoRA` over
    the base expert weights with ``model``'s adapters (no merged copy of the experts, most of a MoE model's
    weights). ``model`` is not changed."""
    layers = lora_layers(model)
    kept = {} if experts else {path: layer for path, layer in layers.items() if isinstance(layer, ExpertsLoRA)}
    deltas = {f"{path}.{name}": delta for path, layer in layers.items() if path not in kept
              for name, delta in layer.deltas().items()}
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
        raise ValueError(f"merge_lora: adapters on {sorted(deltas)} have no matching base weight")
    for parent, name, path in _slots(plain, Experts):
        if path in kept:
            setattr(parent, name, kept[path].over(getattr(parent, name)))
    return plain


def decoding_view(model: Transformer) -> Transformer:
    """The model a sampler decodes with: layers unstacked (:meth:`Transformer.unstacked`) and, when its LoRA
    adapters are on, the Linear adapters merged into a copy of their kernels (:func:`merge_lora`), so a decode
    step runs one matmul per projection with or without adapters; expert adapters stay unmerged (grouped
    matmuls take them as they are; a merged copy of the experts would double a MoE model's memory). Built
    inside the sampler's jit, once per generation: one copy of the layer weights (the unstacked view is one
    already)."""
    view = model.unstacked()
    adapters = lora_layers(view).values()
    if adapters and all(layer.lora_enabled for layer in adapters):
        return merge_lora(view, experts=False)
    return view
