"""cuDNN flash attention through ``jax.nn.dot_product_attention(implementation="cudnn")``.

cuDNN masks by causal order, per-row lengths and a local window, not by arbitrary segments. A padded
row (one contiguous run of real tokens, :attr:`AttentionMask.contiguous`) must have its real tokens start
at index 0; causal attention then never reaches the trailing padding, so no length is needed. Rows whose
run starts elsewhere (left padding) are rolled left here and the output rolled back; the model rolls its
rows once per forward instead (:attr:`AttentionMask.starts_at_zero`), which saves these four rotations in
every layer. Only the output at padding queries differs from the reference (unspecified there by contract).
Packed segments and explicit masks are not supported here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrl.kernels.attention.mask import AttentionMask, roll_rows, run_starts


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


def attention(q, k, v, mask: AttentionMask, *, scale: float) -> jax.Array:
    window = None if mask.sliding_window is None else (mask.sliding_window - 1, 0)

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, local_window_size=window,
                                            implementation="cudnn")

    if mask.starts_at_zero:
        return attend(q, k, v)
    start = run_starts(mask.kv_segments != 0)
    out = attend(roll_rows(q, start), roll_rows(k, start), roll_rows(v, start))
    return roll_rows(out, (q.shape[1] - start) % q.shape[1])
