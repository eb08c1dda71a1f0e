"""Grouped-matmul dispatcher: picks an implementation by backend with an ordered fallback.

| name         | where                         | what                                                     |
|--------------|-------------------------------|----------------------------------------------------------|
| `reference`  | anywhere                      | ``jax.lax.ragged_dot`` (the truth; slow on NVIDIA GPUs)   |
| `pallas_tpu` | TPU (interpret mode elsewhere) | megablox gmm/tgmm with per-pass tiles                    |
| `triton`     | NVIDIA GPU + jax_triton       | Triton grouped GEMM + transposed GEMM (jax-triton)       |
| `mosaic_gpu` | Hopper GPU + jax_triton       | Mosaic GPU gmm (TMA, warp-specialised) for the forward and |
|              |                               | the input gradient; the weight gradient on Triton        |

``impl="auto"`` order: TPU: pallas_tpu, reference. GPU: mosaic_gpu (where its tiles fit the shapes), triton,
reference. CPU: reference.
The pick is logged once per (backend, shapes, dtypes) on the ``jrl.kernels`` logger.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrl.kernels import _dispatch
from jrl.kernels._dispatch import Impl

IMPLS = {
    "reference": Impl("reference", "jrl.kernels.moe.reference", ("cpu", "gpu", "tpu")),
    "pallas_tpu": Impl("pallas_tpu", "jrl.kernels.moe.pallas_tpu", ("tpu",), interpret_ok=True),
    "triton": Impl("triton", "jrl.kernels.moe.triton", ("gpu",)),
    "mosaic_gpu": Impl("mosaic_gpu", "jrl.kernels.moe.mosaic_gpu", ("gpu",)),
}
ORDER = {
    "tpu": ("pallas_tpu", "reference"),
    "gpu": ("mosaic_gpu", "triton", "reference"),
    "cpu": ("reference",),
    "default": ("reference",),
}


def available_impls() -> list[str]:
    """Names accepted by ``impl=`` ("auto" plus every implementation)."""
    return ["auto", *IMPLS]


def _select(impl: str, lhs, rhs, group_sizes, forward: bool = True):
    config = ("gmm", tuple(lhs.shape), str(lhs.dtype), tuple(rhs.shape), str(rhs.dtype), int(group_sizes.shape[0]))

    def call_check(name: str) -> str | None:
        if name == "mosaic_gpu" and forward:  # its tiles must fit the forward's shapes
            from jrl.kernels.moe.mosaic_gpu_kernel import unsupported_reason

            return unsupported_reason(lhs.shape, lhs.dtype, rhs.shape, rhs.dtype)
        return None

    return _dispatch.select("gmm", IMPLS, ORDER, impl, config=config, call_check=call_check)


def _check(lhs, rhs, group_sizes, name="rhs"):
    if lhs.ndim != 2 or rhs.ndim != 3:
        raise ValueError(f"gmm needs lhs [T, K] and {name} [E, K, N]; got {lhs.shape} and {rhs.shape}")
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"gmm: lhs has K={lhs.shape[1]} but {name} [E, K, N] has K={rhs.shape[1]}")
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"gmm: group_sizes must be [E]={rhs.shape[0]}, got shape {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"gmm: group_sizes must be integer, got {group_sizes.dtype}")


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, impl: str = "auto",
        preferred_element_type=None, fill_past_groups: bool = True, **kwargs) -> jax.Array:
    """Grouped matmul ``[T, K] x [E, K, N] -> [T, N]`` over rows sorted by group (see reference.gmm).

    Differentiable wrt ``lhs`` and ``rhs`` (the weight gradient is a transposed grouped matmul).
    ``impl``: "auto" or one of :func:`available_impls`; extra ``kwargs`` (e.g. ``configs=`` tile sizes,
    ``interpret=``) go to the chosen implementation. ``fill_past_groups=False``: the rows past
    ``sum(group_sizes)`` of the output and of the input gradient are unspecified (the GPU kernels leave them
    unwritten), for callers that never read them (an expert-parallel device's buffer, mostly such rows).
    """
    _check(lhs, rhs, group_sizes)
    _, mod = _select(impl, lhs, rhs, group_sizes)
    return mod.gmm(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type,
                   fill_past_groups=fill_past_groups, **kwargs)


def tgmm(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, *, impl: str = "auto",
         preferred_element_type=None, **kwargs) -> jax.Array:
    """Transposed grouped matmul ``out[g] = lhs_g^T @ dout_g`` -> [E, K, N] (gmm's weight gradient)."""
    if lhs.ndim != 2 or dout.ndim != 2 or lhs.shape[0] != dout.shape[0]:
        raise ValueError(f"tgmm needs lhs [T, K] and dout [T, N]; got {lhs.shape} and {dout.shape}")
    fake_rhs = jax.ShapeDtypeStruct((group_sizes.shape[0], lhs.shape[1], dout.shape[1]), dout.dtype)
    _, mod = _select(impl, lhs, fake_rhs, group_sizes, forward=False)
    return mod.tgmm(lhs, dout, group_sizes, preferred_element_type=preferred_element_type, **kwargs)


def gmm_lora(lhs: jax.Array, rhs: jax.Array, lora_a: jax.Array, lora_b: jax.Array, scale, group_sizes: jax.Array,
             *, impl: str = "auto", preferred_element_type=None, fill_past_groups: bool = True) -> jax.Array:
    """Grouped matmul with a LoRA delta per expert: row t of group g gets ``x (W_g + s A_g B_g)``.

    Computed as ``gmm(x, W) + s * gmm(gmm(x, A), B)`` (never materializing the [E, K, N] deltas), with
    ``lora_a`` [E, K, r], ``lora_b`` [E, r, N] and ``scale`` a scalar (PEFT's ``alpha / r``). The
    rank-r intermediate is kept in float32 when ``lhs`` is float32, otherwise in ``lhs``'s dtype (as
    PEFT does). Gradients flow to ``lhs``, ``rhs``, ``lora_a`` and ``lora_b`` (freeze ``rhs`` with
    ``jax.lax.stop_gradient`` for LoRA training). ``fill_past_groups`` as :func:`gmm`.
    """
    _check(lhs, rhs, group_sizes)
    _check(lhs, lora_a, group_sizes, "lora_a")
    if lora_b.ndim != 3 or lora_b.shape[0] != rhs.shape[0] or lora_b.shape[1] != lora_a.shape[2] \
            or lora_b.shape[2] != rhs.shape[2]:
        raise ValueError(f"gmm_lora: lora_b must be [E, r, N] = {(rhs.shape[0], lora_a.shape[2], rhs.shape[2])}, "
                         f"got {lora_b.shape}")
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    fill = dict(impl=impl, fill_past_groups=fill_past_groups)
    base = gmm(lhs, rhs, group_sizes, preferred_element_type=jnp.float32, **fill)
    xa = gmm(lhs, lora_a, group_sizes, preferred_element_type=lhs.dtype, **fill)
    delta = gmm(xa, lora_b, group_sizes, preferred_element_type=jnp.float32, **fill)
    return (base + jnp.asarray(scale, jnp.float32) * delta).astype(out_dtype)
