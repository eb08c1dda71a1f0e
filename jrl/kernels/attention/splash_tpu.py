"""Pallas splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``) for TPU.

GQA runs as one MQA kernel per KV head (the group's G query heads share that head's keys and values,
never repeated); causal order and the sliding window are the kernel's static block-sparse mask, segments
(padding = 0, packed documents) its ``SegmentIds``. Off TPU it runs in Pallas interpret mode (tests).
Explicit dense masks are not supported here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

from jrl.kernels.attention.mask import AttentionMask

BLOCK = 128
"""Sequence tile of the kernel; T and S must be multiples of it."""


def unavailable_reason() -> str | None:
    return None  # runs for real on TPU, in interpret mode elsewhere


def call_unsupported(q, k, mask: AttentionMask) -> str | None:
    """Why this call cannot use splash attention (None when it can)."""
    if mask.explicit is not None:
        return "an explicit mask"
    if q.shape[1] % BLOCK or k.shape[1] % BLOCK:
        return f"T = {q.shape[1]} and S = {k.shape[1]} must be multiples of {BLOCK}"
    return None


@functools.lru_cache(maxsize=32)
def _kernel(t: int, s: int, heads: int, causal: bool, window: int | None, interpret: bool):
    shape = (t, s)
    if window is not None:
        head = masks.LocalMask(shape, window_size=(window - 1, 0 if causal else None), offset=0)
    elif causal:
        head = masks.CausalMask(shape)
    else:
        head = masks.FullMask(shape)
    block = splash.BlockSizes(block_q=BLOCK, block_kv=BLOCK, block_kv_compute=BLOCK, block_q_dkv=BLOCK,
                              block_kv_dkv=BLOCK, block_kv_dkv_compute=BLOCK, block_q_dq=BLOCK, block_kv_dq=BLOCK)
    return splash.make_splash_mqa_single_device(masks.MultiHeadMask([head] * heads), block_sizes=block,
                                                interpret=interpret)


def attention(q, k, v, mask: AttentionMask, *, scale: float, interpret: bool | None = None) -> jax.Array:
    b, t, n, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = n // kh
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret
    kernel = _kernel(t, s, g, mask.causal, mask.sliding_window, interpret)
    # [B, K, G, T, D] queries against [B, K, S, D] keys / values: one MQA call per (row, KV head).
    qg = jnp.transpose((q * jnp.asarray(scale, q.dtype)).reshape(b, t, kh, g, d), (0, 2, 3, 1, 4))
    kt, vt = jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))

    def one(qh, kh_, vh, q_seg, kv_seg):
        return kernel(qh, kh_, vh, segment_ids=splash.SegmentIds(q=q_seg, kv=kv_seg))

    per_head = jax.vmap(one, in_axes=(0, 0, 0, None, None))
    out = jax.vmap(per_head)(qg, kt, vt, mask.q_segments, mask.kv_segments)  # [B, K, G, T, D]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, n, d).astype(v.dtype)
