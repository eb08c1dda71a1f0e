"""cuDNN flash attention through ``jax.nn.dot_product_attention(implementation="cudnn")``.

cuDNN masks by causal order, per-row lengths and a local window, not by arbitrary segments. A padded
row (one contiguous run of real tokens, :attr:`AttentionMask.contiguous`) is rolled left so its real
tokens start at index 0; causal attention then never reaches the trailing padding, so no length is
needed. The output is rolled back. Only the output at padding queries differs from the reference
(unspecified there by contract). Packed segments and explicit masks are not supported here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrl.kernels.attention.mask import AttentionMask


def unavailable_reason() -> str | None:
    if jax.default_backend() not in ("gpu", "cuda"):
        return "needs an NVIDIA GPU"
    return None


def call_unsupported(q, k, mask: AttentionMask) -> str | None:
    """Why this call cannot use cuDNN (None when it can)."""
    if mask.explicit is not None:
        return "an explicit mask"
    if not mask.contiguous or not mask.causal:
        return "needs causal attention over one run of real tokens per row"
    if q.shape[1] != k.shape[1]:
        return "needs self-attention (T == S)"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype:
        return f"needs bf16/fp16 q, k, v (got {q.dtype})"
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        return f"head_dim {q.shape[-1]} is not a multiple of 8 up to 256"
    return None


def _rotate(x: jax.Array, shift: jax.Array) -> jax.Array:
    """Row r of x [B, S, ...] rotated left by ``shift[r]`` (a gather)."""
    s = x.shape[1]
    idx = (jnp.arange(s, dtype=jnp.int32)[None, :] + shift[:, None]) % s
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


@jax.custom_vjp
def _roll_rows(x: jax.Array, shift: jax.Array) -> jax.Array:
    """:func:`_rotate` whose gradient is the opposite rotation (another gather), not the scatter-add autodiff
    makes of a gather: a rotation is a permutation, so its transpose is its inverse."""
    return _rotate(x, shift)


def _roll_rows_fwd(x, shift):
    return _rotate(x, shift), shift


def _roll_rows_bwd(shift, g):
    return _rotate(g, (g.shape[1] - shift) % g.shape[1]), None


_roll_rows.defvjp(_roll_rows_fwd, _roll_rows_bwd)


def attention(q, k, v, mask: AttentionMask, *, scale: float) -> jax.Array:
    real = mask.kv_segments != 0
    start = jnp.where(jnp.any(real, axis=1), jnp.argmax(real, axis=1), 0).astype(jnp.int32)
    window = None if mask.sliding_window is None else (mask.sliding_window - 1, 0)
    out = jax.nn.dot_product_attention(_roll_rows(q, start), _roll_rows(k, start), _roll_rows(v, start),
                                       scale=scale, is_causal=True, local_window_size=window,
                                       implementation="cudnn")
    return _roll_rows(out, (q.shape[1] - start) % q.shape[1])
