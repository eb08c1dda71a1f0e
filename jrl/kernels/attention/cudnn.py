"""cuDNN flash attention through ``jax.nn.dot_product_attention(implementation="cudnn")``.

cuDNN masks by causal order, per-row lengths and a local window, not by arbitrary segments. A padded
row (one contiguous run of real tokens, :attr:`AttentionMask.contiguous`) must have its real tokens start
at index 0; causal attention then never reaches the trailing padding, so no length is needed. Rows whose
run starts elsewhere (left padding) are rolled left here and the output rolled back; the model rolls its
rows once per forward instead (:attr:`AttentionMask.starts_at_zero`), which saves these four rotations in
every layer. Only the output at padding queries differs from the reference (unspecified there by contract).

Packed rows whose runs are bounded (:attr:`AttentionMask.max_segments`) go through cuDNN's packed layout (Hopper
or later): each run, padding runs included, is a sequence of its own given by its start and length, so no FLOP is
spent across documents. That layout is reached through JAX's cuDNN module (``jax.nn.dot_product_attention`` does
not expose it); a JAX without it makes such calls fall to the next implementation. Packed rows with a sliding
window and explicit masks are not supported here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrl.kernels.attention.mask import AttentionMask, roll_rows, run_starts, segment_runs

try:  # the packed layout's entry point (private to JAX; probed, never required)
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention as _cudnn_attention
except ImportError:  # pragma: no cover - depends on the JAX build
    _cudnn_attention = None


def unavailable_reason() -> str | None:
    if jax.default_backend() not in ("gpu", "cuda"):
        return "needs an NVIDIA GPU"
    return None


def _packed_unsupported(mask: AttentionMask) -> str | None:
    if mask.max_segments is None:
        return "needs causal attention over one run of real tokens per row (or packed rows with max_segments)"
    if mask.sliding_window is not None:
        return "packed rows with a sliding window"
    if _cudnn_attention is None:
        return "this JAX has no cuDNN packed layout"
    if int(str(getattr(jax.devices()[0], "compute_capability", "0")).split(".")[0]) < 9:
        return "packed rows need a Hopper or later GPU"
    return None


def call_unsupported(q, k, mask: AttentionMask) -> str | None:
    """Why this call cannot use cuDNN (None when it can)."""
    if mask.explicit is not None:
        return "an explicit mask"
    if not mask.causal:
        return "needs causal attention"
    if not mask.contiguous and (reason := _packed_unsupported(mask)) is not None:
        return reason
    if q.shape[1] != k.shape[1]:
        return "needs self-attention (T == S)"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype:
        return f"needs bf16/fp16 q, k, v (got {q.dtype})"
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        return f"head_dim {q.shape[-1]} is not a multiple of 8 up to 256"
    return None


def attention(q, k, v, mask: AttentionMask, *, scale: float) -> jax.Array:
    if not mask.contiguous:
        return _packed_attention(q, k, v, mask, scale=scale)
    window = None if mask.sliding_window is None else (mask.sliding_window - 1, 0)

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, local_window_size=window,
                                            implementation="cudnn")

    if mask.starts_at_zero:
        return attend(q, k, v)
    start = run_starts(mask.kv_segments != 0)
    out = attend(roll_rows(q, start), roll_rows(k, start), roll_rows(v, start))
    return roll_rows(out, (q.shape[1] - start) % q.shape[1])


def _packed_attention(q, k, v, mask: AttentionMask, *, scale: float) -> jax.Array:
    """Causal attention within each run of ``mask``'s segments, through cuDNN's packed layout."""
    # At least two runs: JAX reads a single one as the unpacked layout.
    start, length = segment_runs(mask.q_segments, max(mask.max_segments, 2))
    # [B, M + 1]: one more entry than runs (the layout's end marker; -1 = none here).
    offsets = jnp.concatenate([start, jnp.full_like(start[:, :1], -1)], axis=1)
    return _cudnn_attention(q, k, v, None, None, length, length, offsets, offsets, scale=scale,
                            mask_type=MaskType.PADDING_CAUSAL, qkv_layout="BTNH")
