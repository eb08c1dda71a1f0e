"""Attention dispatcher: picks an implementation by backend with an ordered fallback.

| name        | where                       | what                                                                 |
|-------------|-----------------------------|----------------------------------------------------------------------|
| `reference` | anywhere                    | the whole [B, N, T, S] float32 score tensor (the truth)              |
| `xla`       | anywhere                    | blocked online softmax + recomputing custom VJP; memory O(block²)    |
| `cudnn`     | NVIDIA GPU                  | cuDNN flash attention (bf16/fp16, causal over padded rows, window)   |
| `splash`    | TPU (interpret mode elsewhere) | Pallas splash attention (causal, segments, window)                |

``impl="auto"`` order: GPU: cudnn, reference (short rows), xla. TPU: splash, xla. CPU: reference (short
rows), xla. "Short" means at most :data:`DENSE_MAX_SCORES` scores per (row, head): the dense path is the
fastest XLA program there, the blocked one is what fits beyond. The pick is logged once per
configuration on the ``jrl.kernels`` logger.

:func:`decode_attention` is the one-query-per-row case of a decode step over a KV cache:

| name         | where                         | what                                                         |
|--------------|-------------------------------|--------------------------------------------------------------|
| `reference`  | anywhere                      | dense scores over every cache slot (the truth)               |
| `pallas_gpu` | NVIDIA GPU (interpret mode elsewhere) | reads only the slots between each row's first and last allowed one |

``impl="auto"`` order: GPU: pallas_gpu, reference. Elsewhere: reference.

:func:`decode_attention_append` is the same step with the step's own rope and cache write folded in (same
implementations; the kernel rotates the queries and the new keys, stores the new keys and values in the cache in
place, and reads the cache only before the step's slot).

:func:`paged_decode_attention` is a decode step over a paged cache (fixed-size pages of a shared pool, a page table
per row):

| name         | where                         | what                                                         |
|--------------|-------------------------------|--------------------------------------------------------------|
| `reference`  | anywhere                      | each row's pages gathered into a dense cache (the truth)     |
| `pallas_gpu` | NVIDIA GPU (interpret mode elsewhere) | JAX's Pallas paged attention: reads only the pages up to each row's length |
| `pallas_tpu` | TPU (interpret mode elsewhere) | JAX's Pallas TPU paged attention (bfloat16 only)           |

``impl="auto"`` order: GPU: pallas_gpu, reference. TPU: pallas_tpu, reference. Elsewhere: reference.

:func:`paged_decode_attention_append` is that step with the step's rope and page write folded in: on a GPU one
kernel (`pallas_gpu`: rope, the write to the reserved page slot and the attention, as :func:`decode_attention_append`
does for a contiguous cache); elsewhere, and for calls the kernel refuses, the rope and the write in plain JAX and
the attention through :func:`paged_decode_attention` under the same ``impl``.

A pool may be narrower than the queries (float8 keys and values, half a bfloat16 pool's bytes): the fused kernel and
the reference widen each block as they read it; JAX's kernels (`pallas_gpu` and `pallas_tpu` above) take a pool of
the queries' dtype only, so such calls fall back to the reference.
"""

from __future__ import annotations

import jax

from jrl.kernels import _dispatch
from jrl.kernels._dispatch import Impl
from jrl.kernels.attention.gathered import collapse_rows, expand_rows
from jrl.kernels.attention.mask import AttentionMask

IMPLS = {
    "reference": Impl("reference", "jrl.kernels.attention.reference", ("cpu", "gpu", "tpu")),
    "xla": Impl("xla", "jrl.kernels.attention.xla", ("cpu", "gpu", "tpu")),
    "cudnn": Impl("cudnn", "jrl.kernels.attention.cudnn", ("gpu",)),
    "splash": Impl("splash", "jrl.kernels.attention.splash_tpu", ("tpu",), interpret_ok=True),
}
ORDER = {
    "gpu": ("cudnn", "reference", "xla"),
    "tpu": ("splash", "xla"),
    "cpu": ("reference", "xla"),
    "default": ("reference", "xla"),
}
DENSE_MAX_SCORES = 2048 * 2048
"""``auto`` uses the dense reference only while T * S is at most this."""


DECODE_IMPLS = {
    "reference": Impl("reference", "jrl.kernels.attention.reference", ("cpu", "gpu", "tpu")),
    "pallas_gpu": Impl("pallas_gpu", "jrl.kernels.attention.decode_pallas_gpu", ("gpu",), interpret_ok=True),
}
DECODE_ORDER = {"gpu": ("pallas_gpu", "reference"), "default": ("reference",)}

PAGED_IMPLS = {
    "reference": Impl("reference", "jrl.kernels.attention.paged_reference", ("cpu", "gpu", "tpu")),
    "pallas_gpu": Impl("pallas_gpu", "jrl.kernels.attention.paged_pallas_gpu", ("gpu",), interpret_ok=True),
    "pallas_tpu": Impl("pallas_tpu", "jrl.kernels.attention.paged_pallas_tpu", ("tpu",), interpret_ok=True),
}
PAGED_ORDER = {"gpu": ("pallas_gpu", "reference"), "tpu": ("pallas_tpu", "reference"), "default": ("reference",)}

PAGED_APPEND_IMPLS = {
    "reference": Impl("reference", "jrl.kernels.attention.paged_reference", ("cpu", "gpu", "tpu")),
    "pallas_gpu": Impl("pallas_gpu", "jrl.kernels.attention.decode_pallas_gpu", ("gpu",), interpret_ok=True),
}
PAGED_APPEND_ORDER = {"gpu": ("pallas_gpu", "reference"), "default": ("reference",)}


def available_impls() -> list[str]:
    """Names accepted by ``impl=`` ("auto" plus every implementation)."""
    return ["auto", *IMPLS]


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask, *, impl: str = "auto",
              scale: float | None = None, **kwargs) -> jax.Array:
    """Grouped-query softmax attention under a structured mask.

    Args:
      q: [B, T, N, D] queries; k, v: [B, S, K, D] keys and values with N % K == 0 (never repeated).
      mask: which keys each query attends to (:class:`AttentionMask`); with ``mask.expand`` the rules are of the
        gathered layout, which any implementation runs on.
      impl: "auto" or one of :func:`available_impls`.
      scale: score scale (default D ** -0.5).
      **kwargs: implementation options (``block_q=`` / ``block_k=`` for xla, ``interpret=`` for splash).

    Returns:
      [B, T, N, D] in v's dtype; scores and softmax in float32. Outputs at padding queries are
      unspecified (finite).
    """
    if mask.expand is not None:  # over the gathered layout, each token taking its first position's output
        q, k, v = (expand_rows(x, mask.expand, mask.copies) for x in (q, k, v))
        out = attention(q, k, v, mask.gathered(), impl=impl, scale=scale, **kwargs)
        return collapse_rows(out, mask.expand, mask.copies)
    b, t, n, d = q.shape
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or n % k.shape[2]:
        raise ValueError(f"attention needs q [B, T, N, D] and k = v [B, S, K, D] with N % K == 0; got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if mask.shape != (b, t, k.shape[1]):
        raise ValueError(f"mask is for (batch, queries, keys) = {mask.shape}, inputs are {(b, t, k.shape[1])}")
    scale = d ** -0.5 if scale is None else float(scale)

    def call_check(name: str) -> str | None:
        if name == "reference" and impl == "auto" and t * k.shape[1] > DENSE_MAX_SCORES:
            return f"T * S = {t * k.shape[1]} > {DENSE_MAX_SCORES} (too long for dense scores)"
        if name in ("cudnn", "splash"):
            return IMPLS[name].load().call_unsupported(q, k, mask)
        return None

    config = (tuple(q.shape), tuple(k.shape), str(q.dtype), f"causal={mask.causal}",
              f"window={mask.sliding_window}", f"contiguous={mask.contiguous}",
              f"max_segments={mask.max_segments}", f"explicit={mask.explicit is not None}")
    _, mod = _dispatch.select("attention", IMPLS, ORDER, impl, config=config, call_check=call_check)
    return mod.attention(q, k, v, mask, scale=scale, **kwargs)


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, *, impl: str = "auto",
                     scale: float | None = None, **kwargs) -> jax.Array:
    """Grouped-query attention of one query per row over a KV cache.

    Args:
      q: [B, N, D] queries; k, v: [B, S, K, D] the cache (N % K == 0, never repeated).
      allowed: bool [B, S], the slots each row's query attends to.
      impl: "auto" or a name of :data:`DECODE_IMPLS`.
      scale: score scale (default D ** -0.5).
      **kwargs: implementation options (``block_k=`` / ``num_warps=`` / ``num_stages=`` / ``interpret=`` for
        pallas_gpu).

    Returns:
      [B, N, D] in v's dtype; scores and softmax in float32. The output of a row with no allowed slot is
      unspecified (finite).
    """
    b, n, d = q.shape
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or n % k.shape[2]:
        raise ValueError(f"decode_attention needs q [B, N, D] and k = v [B, S, K, D] with N % K == 0; got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if allowed.shape != (b, k.shape[1]):
        raise ValueError(f"allowed is for (batch, slots) = {allowed.shape}, the cache is {(b, k.shape[1])}")
    scale = d ** -0.5 if scale is None else float(scale)
    config = (tuple(q.shape), tuple(k.shape), str(q.dtype))

    def call_check(name: str) -> str | None:
        return DECODE_IMPLS[name].load().call_unsupported(q, k) if name == "pallas_gpu" else None

    _, mod = _dispatch.select("decode_attention", DECODE_IMPLS, DECODE_ORDER, impl, config=config,
                              call_check=call_check)
    return mod.decode_attention(q, k, v, allowed, scale=scale, **kwargs)


def decode_attention_append(qkv: jax.Array, cos: jax.Array, sin: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                            allowed: jax.Array, index: jax.Array | int, *, impl: str = "auto",
                            scale: float | None = None, **kwargs) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A decode step's attention including the step's rope and KV-cache write.

    Args:
      qkv: [B, N + 2K, D] the step's queries (N heads), keys and values (K heads each), in that order, before
        rope: one array, so that a fused q/k/v projection's output is handed over without being sliced.
      cos, sin: [B, R] the rope of each row's position (R <= D; "rotate_half" layout, see
        :func:`jrl.kernels.attention.rope.apply_rope`).
      k_cache, v_cache: [B, S, K, D] the cache (rope applied), N % K == 0.
      allowed: bool [B, S], the slots each row's query attends to (the step's slot ``index`` included).
      index: the cache slot the step's keys and values are written to (the same for every row).
      impl, scale, kwargs: as :func:`decode_attention`.

    Returns:
      (output [B, N, D] in the cache's dtype, k_cache, v_cache with slot ``index`` written).
    """
    b, s, kv, d = k_cache.shape if k_cache.ndim == 4 else (0, 0, 0, 0)
    n = qkv.shape[1] - 2 * kv if qkv.ndim == 3 else 0
    if (k_cache.ndim != 4 or k_cache.shape != v_cache.shape or qkv.ndim != 3 or qkv.shape[0] != b
            or qkv.shape[2] != d or n <= 0 or n % kv):
        raise ValueError(f"decode_attention_append needs qkv [B, N + 2K, D] and k_cache = v_cache [B, S, K, D] with "
                         f"N % K == 0; got {qkv.shape}, {k_cache.shape}, {v_cache.shape}")
    if allowed.shape != (b, s) or cos.shape != sin.shape or cos.shape[0] != b or cos.shape[1] > d:
        raise ValueError(f"allowed must be [B, S] = {(b, s)} and cos = sin [B, R <= D]; got {allowed.shape}, "
                         f"{cos.shape}, {sin.shape}")
    scale = d ** -0.5 if scale is None else float(scale)
    queries = jax.ShapeDtypeStruct((b, n, d), qkv.dtype)
    config = ("append", tuple(qkv.shape), tuple(k_cache.shape), str(qkv.dtype), cos.shape[1])

    def call_check(name: str) -> str | None:
        if name != "pallas_gpu":
            return None
        return DECODE_IMPLS[name].load().call_unsupported_append(queries, k_cache, cos)

    _, mod = _dispatch.select("decode_attention_append", DECODE_IMPLS, DECODE_ORDER, impl, config=config,
                              call_check=call_check)
    return mod.decode_attention_append(qkv, cos, sin, k_cache, v_cache, allowed, index, scale=scale, **kwargs)


def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array,
                           lengths: jax.Array, *, impl: str = "auto", scale: float | None = None,
                           window: int | None = None, **kwargs) -> jax.Array:
    """Grouped-query attention of one query per row over a paged KV cache.

    Args:
      q: [B, N, D] queries.
      k_pages, v_pages: [K, P, page_size, D] the page pool (N % K == 0, never repeated).
      page_table: int32 [B, M], row b's pages in order (slot s of the row is slot ``s % page_size`` of page
        ``page_table[b, s // page_size]``); entries past the row's length are not read.
      lengths: int32 [B], the slots each row's query attends to (its first ``lengths[b]``; with ``window``, only
        the last ``window`` of them: a sliding window, the query being the row's last slot).
      impl: "auto" or a name of :data:`PAGED_IMPLS`.
      scale: score scale (default D ** -0.5).
      **kwargs: implementation options (``interpret=`` for the Pallas kernels).

    Returns:
      [B, N, D] in q's dtype; scores and softmax in float32 (a float8 pool read in float16, the queries too:
      :func:`jrl.kernels.attention.paged_reference.read_dtype`).
      The output of a row of length 0 is unspecified (finite).
    """
    b, n, d = q.shape
    if (k_pages.ndim != 4 or k_pages.shape != v_pages.shape or k_pages.shape[3] != d or n % k_pages.shape[0]
            or page_table.ndim != 2 or page_table.shape[0] != b or lengths.shape != (b,)):
        raise ValueError(f"paged_decode_attention needs q [B, N, D], k_pages = v_pages [K, P, page_size, D] with "
                         f"N % K == 0, page_table [B, M] and lengths [B]; got {q.shape}, {k_pages.shape}, "
                         f"{v_pages.shape}, {page_table.shape}, {lengths.shape}")
    scale = d ** -0.5 if scale is None else float(scale)
    config = ("paged", tuple(q.shape), tuple(k_pages.shape), tuple(page_table.shape), str(q.dtype), window)

    def call_check(name: str) -> str | None:
        if name == "reference":
            return None
        if window is not None:
            return f"a sliding window ({window})"
        return PAGED_IMPLS[name].load().call_unsupported(q, k_pages)

    _, mod = _dispatch.select("paged_decode_attention", PAGED_IMPLS, PAGED_ORDER, impl, config=config,
                              call_check=call_check)
    if window is not None:  # the reference only (the kernels refuse a window above)
        kwargs = {**kwargs, "window": window}
    return mod.paged_decode_attention(q, k_pages, v_pages, page_table, lengths, scale=scale, **kwargs)


def paged_decode_attention_append(qkv: jax.Array, cos: jax.Array, sin: jax.Array, k_pages: jax.Array,
                                  v_pages: jax.Array, page_table: jax.Array, lengths: jax.Array, page: jax.Array,
                                  offset: jax.Array, *, impl: str = "auto", scale: float | None = None,
                                  window: int | None = None, **kwargs) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A paged decode step's attention including the step's rope and its write to the pool.

    Args:
      qkv: [B, N + 2K, D] the step's queries, keys and values before rope (as :func:`decode_attention_append`).
      cos, sin: [B, R] the rope of each row's position.
      k_pages, v_pages: [K, P, page_size, D] the page pool (rope applied).
      page_table: int32 [B, M]; lengths: int32 [B], the slots each row attends to after the write (as
        :func:`paged_decode_attention`).
      page, offset: int32 [B], where row b's new key and value are written; for the output to be defined this is
        the row's slot ``lengths[b] - 1`` (a row that writes elsewhere, e.g. a stopped row pointed at a scratch
        page, gets an unspecified finite output).
      impl: "auto", a name of :data:`PAGED_APPEND_IMPLS` or of :data:`PAGED_IMPLS` (the rope and the write in plain
        JAX, then that attention); without the fused kernel, the :func:`paged_decode_attention` implementation.
      scale, window, kwargs: as :func:`paged_decode_attention`.

    Returns:
      (output [B, N, D] in qkv's dtype, k_pages, v_pages with the step's keys and values written in the pool's
      dtype, a float8 pool's clipped to its finite range: :func:`jrl.kernels.attention.paged_reference.stored_as`).
    """
    kv = k_pages.shape[0] if k_pages.ndim == 4 else 0
    b, n = qkv.shape[0], (qkv.shape[1] - 2 * kv if qkv.ndim == 3 else 0)
    if (k_pages.ndim != 4 or k_pages.shape != v_pages.shape or qkv.ndim != 3 or qkv.shape[2] != k_pages.shape[3]
            or n <= 0 or n % kv or cos.shape != sin.shape or cos.shape[0] != b or cos.shape[1] > qkv.shape[2]
            or page.shape != (b,) or offset.shape != (b,)):
        raise ValueError(f"paged_decode_attention_append needs qkv [B, N + 2K, D], k_pages = v_pages [K, P, "
                         f"page_size, D], cos = sin [B, R <= D] and page = offset [B]; got {qkv.shape}, "
                         f"{k_pages.shape}, {v_pages.shape}, {cos.shape}, {sin.shape}, {page.shape}, {offset.shape}")
    scale = qkv.shape[2] ** -0.5 if scale is None else float(scale)
    queries = jax.ShapeDtypeStruct((b, n, qkv.shape[2]), qkv.dtype)
    config = ("paged_append", tuple(qkv.shape), tuple(k_pages.shape), tuple(page_table.shape), str(qkv.dtype),
              window)

    def call_check(name: str) -> str | None:
        if name == "reference":
            return None
        if window is not None:
            return f"a sliding window ({window})"
        return PAGED_APPEND_IMPLS[name].load().call_unsupported_paged_append(queries, k_pages, cos)

    name, mod = _dispatch.select("paged_decode_attention_append", PAGED_APPEND_IMPLS, PAGED_APPEND_ORDER,
                                 impl if impl == "auto" or impl in PAGED_APPEND_IMPLS else "reference", config=config,
                                 call_check=call_check)
    if name == "pallas_gpu":
        return mod.paged_decode_attention_append(qkv, cos, sin, k_pages, v_pages, page_table, lengths, page, offset,
                                                 scale=scale, **kwargs)
    q, k_pages, v_pages = mod.rope_and_write_pages(qkv, cos, sin, k_pages, v_pages, page, offset)
    out = paged_decode_attention(q, k_pages, v_pages, page_table, lengths, impl=impl, scale=scale, window=window,
                                 **kwargs)
    return out, k_pages, v_pages
