"""One-token decode attention over a KV cache as a Pallas (Triton backend) kernel for NVIDIA GPUs.

A decode step has one query per row and a cache of ``S`` slots of which only a prefix is filled (and, after
left padding, only a suffix of that prefix is real). The dense path reads all ``S`` slots of K and V and
runs five XLA kernels (two matmuls, max, sum, normalise). Here one program per (row, KV head) walks the
cache blocks between the row's first and last allowed slot with an online softmax in float32, so the
unfilled tail (and the padding head) of the cache is never read, the ``G = N / K`` query heads of a KV head
share each loaded block (no repeated KV), and the output is normalised in the same kernel.

:func:`decode_attention_append` is the same walk with the step's own work folded in: the program rotates its
queries and the step's key (rope), attends over the cache before the step's slot, adds the step's key and value
to the softmax from registers and writes them to the cache (aliased, so updated in place), instead of three
XLA kernels for rope and the cache writes before the attention.

:func:`paged_decode_attention_append` is that step over a paged cache (a pool of fixed-size pages, a page table per
row): each block's slots are gathered through the row's table in one load (the pool seen as rows of a head's
pages one after another) and the step's key and value are written to the page and offset the caller reserved for
them. The pool may be narrower than the queries (float8 keys and values): blocks are widened as they are loaded.

Off GPU all three run in Pallas interpret mode (tests compare them with :mod:`.reference` and
:mod:`.paged_reference`).

"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jrl.kernels.attention.paged_reference import is_float8, read_dtype, stored_as

_MIN_ROWS = 16
"""Triton's matrix product needs at least 16 rows: a program loads 16 query rows from its KV head's first
(masked past the G = N / K heads of the group), so G is at most 16."""
_MASKED = -1e30
"""Score of a disallowed slot (finite, so a block with no allowed slot leaves the running max defined)."""
_LOG2E, _LN2 = math.log2(math.e), math.log(2.0)


def unavailable_reason() -> str | None:
    return None  # compiled on an NVIDIA GPU, in interpret mode elsewhere


def _exp2(interpret: bool):
    """Elementwise 2 ** x in float32 for the kernels' softmax: the GPU's ``ex2.approx`` when compiled (one
    instruction an element, relative error ~2 ** -22; the lowering of ``jnp.exp`` and ``jnp.exp2`` calls libdevice's
    accurate functions, ~8 instructions an element, a fifth of a float8 pool's block loop), ``jnp.exp2`` when
    interpreted."""
    if interpret:
        return jnp.exp2

    def approx(x):
        [out] = plgpu.elementwise_inline_asm("ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
                                             result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, x.dtype)])
        return out

    return approx


def _attend_blocks(q, blocks, lo, hi, *, scale: float, block_k: int, exp2):
    """Online softmax of one (row, KV head) with queries ``q`` [16, D] over the cache blocks holding slots [lo, hi)
    (slots outside, and slots not allowed, get no weight). ``blocks``: (``load(j, in_range)`` -> K and V [block_k, D]
    of block ``j``, ``allowed(j, in_range)`` or None) (:func:`_cache_blocks`, :func:`_page_blocks`). None says every
    slot in range is allowed: each block the loop visits then holds one, so the running max is a real score and a
    masked score's ``exp`` is 0 without a second mask on the probabilities (one select fewer per block: 6-8% of a
    float8 pool's step, ``benchmarks/RESULTS.md``). Scores are kept in base 2 (scaled by log2(e) with the softmax
    scale) for ``exp2`` (:func:`_exp2`).
    Returns the unnormalised (acc [16, D], running max [16], running sum [16]) in float32, the max in natural units."""
    load, allowed = blocks
    offsets = jnp.arange(block_k)
    exact = False if q.dtype == jnp.float32 else None  # float32: no TF32 rounding in the products

    def body(j, carry):
        acc, m, l = carry
        idx = j * block_k + offsets
        in_range = (idx >= lo) & (idx < hi)
        k, v = load(j, in_range)
        ok = in_range if allowed is None else allowed(j, in_range) & in_range
        s = plgpu.dot(q, k, trans_b=True, allow_tf32=exact) * (scale * _LOG2E)  # [16, block_k], base 2
        s = jnp.where(ok[None, :], s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = exp2(m - m_new)
        p = exp2(s - m_new[:, None])
        if allowed is not None:  # a block of disallowed slots only: its scores are all _MASKED, and so may be m_new
            p = jnp.where(ok[None, :], p, 0.0)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, allow_tf32=exact)
        return acc, m_new, l * alpha + jnp.sum(p, axis=1)

    init = (jnp.zeros((_MIN_ROWS, q.shape[1]), jnp.float32), jnp.full((_MIN_ROWS,), _MASKED, jnp.float32),
            jnp.zeros((_MIN_ROWS,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(lo // block_k, pl.cdiv(hi, block_k), body, init)
    return acc, jnp.where(m > _MASKED, m * _LN2, _MASKED), l


def _cache_blocks(k_ref, v_ref, allowed_ref, block_k: int):
    """Block loaders of a contiguous cache: k_ref / v_ref [S, D], allowed_ref [S] int8."""
    def window(j):
        return pl.ds(j * block_k, block_k)

    def load(j, m):
        return (plgpu.load(k_ref.at[window(j), :], mask=m[:, None], other=0.0),
                plgpu.load(v_ref.at[window(j), :], mask=m[:, None], other=0.0))

    return load, lambda j, m: plgpu.load(allowed_ref.at[window(j)], mask=m, other=0) != 0


def _page_blocks(k_ref, v_ref, table_ref, page_size: int, block_k: int, dtype):
    """Block loaders of a paged cache: k_ref / v_ref [P x page_size, D] (one KV head's pool, its pages one after
    another), table_ref [M] (the row's pages in order, padded with the scratch page to whole blocks); every slot in
    range is allowed; blocks are read in ``dtype`` (:func:`read_dtype`). A block's ``block_k`` slots are gathered row
    by row (slot t of the row is row ``table[t // page_size] x page_size + t % page_size`` of the pool), so a block
    may span several pages or part of one and the loads need no reshape. Slots out of range are read (the table's
    padding points at a real page) and get no weight."""
    offsets = jnp.arange(block_k)
    shift = page_size.bit_length() - 1  # slots are not negative, and pages a power of two: no signed division

    def load(j, m):
        slot = j * block_k + offsets
        rows = table_ref[slot >> shift] * page_size + (slot & (page_size - 1))
        return k_ref[rows, :].astype(dtype), v_ref[rows, :].astype(dtype)

    return load, None


def _store_normalised(o_ref, heads, row_ok, acc, l):
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]  # a row with no allowed slot: zeros
    plgpu.store(o_ref.at[heads, :], out.astype(o_ref.dtype), mask=row_ok)


def _normalised_into(o_ref):
    """The store of a program that saw all of its row's slots: the normalised output into o_ref [N, D]."""
    return lambda heads, row_ok, acc, m, l: _store_normalised(o_ref, heads, row_ok, acc, l)


def _parts_into(o_ref, m_ref, l_ref):
    """The store of a program that saw one split of its row's slots: the unnormalised float32 output into o_ref
    [N, D], the running max and sum into m_ref / l_ref [N] (combined by :func:`_combine_splits`)."""
    def store(heads, row_ok, acc, m, l):
        plgpu.store(o_ref.at[heads, :], acc, mask=row_ok)
        plgpu.store(m_ref.at[heads], m, mask=row_ok[:, 0])
        plgpu.store(l_ref.at[heads], l, mask=row_ok[:, 0])
    return store


def _combine_splits(parts, m, l, dtype):
    """One output [B, N, D] from the splits' parts [B, splits, N, D] and running max / sum [B, splits, N]."""
    weight = jnp.exp(m - jnp.max(m, axis=1, keepdims=True))
    total = jnp.sum(weight * l, axis=1)
    out = jnp.sum(weight[..., None] * parts, axis=1) / jnp.where(total > 0, total, 1.0)[..., None]
    return out.astype(dtype)


def _heads(group: int):
    """The program's query heads (``group`` of them from ``head * group``, padded to Triton's 16 rows)."""
    return pl.ds(pl.program_id(1) * group, _MIN_ROWS), (jnp.arange(_MIN_ROWS) < group)[:, None]


def _kernel(bounds_ref, q_ref, k_ref, v_ref, allowed_ref, o_ref, *, scale: float, block_k: int, group: int, exp2):
    """One (row, KV head): q_ref / o_ref [N, D] (this row's heads), k_ref / v_ref [S, D], allowed_ref [S] int8,
    bounds_ref [2] int32 = (first, last + 1) allowed slot of this row."""
    heads, row_ok = _heads(group)
    q = plgpu.load(q_ref.at[heads, :], mask=row_ok, other=0.0)
    acc, _, l = _attend_blocks(q, _cache_blocks(k_ref, v_ref, allowed_ref, block_k), bounds_ref[0],
                               bounds_ref[1], scale=scale, block_k=block_k, exp2=exp2)
    _store_normalised(o_ref, heads, row_ok, acc, l)


def _rotated(x, x_partner, cos, sin, dtype):
    """Rope (rotate_half) in float32 of ``x`` [R, D], given ``x_partner``, the same rows with their halves swapped,
    rounded to ``dtype`` as :func:`jrl.kernels.attention.rope.apply_rope` rounds it (the same float32 operations:
    x * cos + (-x2, x1) * sin)."""
    d = x.shape[1]
    sign = jnp.where(jnp.arange(d) < d // 2, -1.0, 1.0)
    return (x.astype(jnp.float32) * cos + sign * x_partner.astype(jnp.float32) * sin).astype(dtype)


def _step_with_new_token(qkv_ref, cos_ref, sin_ref, n: int, blocks, lo, hi, new_ok, new_slot, store, *,
                         scale: float, block_k: int, group: int, exp2):
    """One (row, KV head) of a decode step with its rope and cache write: qkv_ref [N + 2K, D] (this row's queries,
    then the step's keys, then its values), cos_ref / sin_ref [D]. The cache (``blocks``) is read over slots
    [lo, hi) only; the step's key and value enter the softmax from registers (with weight when ``new_ok``) and are
    written last, at ``new_slot(value)`` (a [1, D] view of the aliased key or value cache). ``store(heads, row_ok,
    acc, running max, running sum)`` writes the result (:func:`_normalised_into`, :func:`_parts_into`).
    Queries and key are rotated whole (their half-swapped copies loaded through permuted columns), so each cache
    block is one [block_k, D] load and one product."""
    heads, row_ok = _heads(group)
    kv_heads = (qkv_ref.shape[0] - n) // 2
    d = qkv_ref.shape[1]
    # rotate_half's source column of each column: the second half's columns, then the first's, as [1, 2, D/2] so
    # each half loads as a contiguous vector (one [D] index vector takes a load per column)
    half = d // 2
    partner = ((1 - jnp.arange(2))[:, None] * half + jnp.arange(half)[None, :])[None]  # [1, 2, D/2]
    cos, sin = cos_ref[...], sin_ref[...]
    dtype = qkv_ref.dtype
    head_rows = (pl.program_id(1) * group + jnp.arange(_MIN_ROWS))[:, None, None]
    q_partner = plgpu.load(qkv_ref.at[head_rows, partner], mask=row_ok[:, :, None], other=0.0).reshape(_MIN_ROWS, d)
    q = _rotated(plgpu.load(qkv_ref.at[heads, :], mask=row_ok, other=0.0), q_partner, cos, sin, dtype)
    key = n + pl.program_id(1)
    k_at, v_at = new_slot(False), new_slot(True)
    k_partner = qkv_ref[key + jnp.zeros_like(partner), partner].reshape(1, d)
    k_new = stored_as(_rotated(qkv_ref[pl.ds(key, 1), :], k_partner, cos, sin, dtype), k_at.dtype)  # [1, D], as stored
    v_new = stored_as(qkv_ref[pl.ds(n + kv_heads + pl.program_id(1), 1), :], v_at.dtype)  # [1, D]
    q = q.astype(read_dtype(dtype, k_at.dtype))
    acc, m, l = _attend_blocks(q, blocks, lo, hi, scale=scale, block_k=block_k, exp2=exp2)
    f32 = jnp.float32
    s = jnp.sum(q.astype(f32) * k_new.astype(f32), axis=1)
    s = jnp.where(new_ok, s * scale, _MASKED)
    m_new = jnp.maximum(m, s)
    alpha = jnp.exp(m - m_new)
    p = jnp.where(new_ok, jnp.exp(s - m_new), 0.0)
    p_rounded = p.astype(q.dtype).astype(f32)  # as the loop's probabilities before their product with V
    acc = acc * alpha[:, None] + p_rounded[:, None] * v_new.astype(f32)
    store(heads, row_ok, acc, m_new, l * alpha + p)
    plgpu.store(k_at, k_new)
    plgpu.store(v_at, v_new)


def _append_kernel(bounds_ref, qkv_ref, cos_ref, sin_ref, k_ref, v_ref, allowed_ref, o_ref, ko_ref, vo_ref, *,
                   scale: float, block_k: int, group: int, exp2):
    """:func:`_step_with_new_token` over a contiguous cache: k_ref / v_ref (and their aliases ko_ref / vo_ref)
    [S, D], allowed_ref [S] int8, bounds_ref [4] int32 = (first allowed slot, one past the last allowed slot before
    the step's, the step's slot, whether that slot is allowed)."""
    slot = pl.ds(bounds_ref[2], 1)

    def new_slot(value):
        return (vo_ref if value else ko_ref).at[slot, :]

    _step_with_new_token(qkv_ref, cos_ref, sin_ref, o_ref.shape[0], _cache_blocks(k_ref, v_ref, allowed_ref, block_k),
                         bounds_ref[0], bounds_ref[1], bounds_ref[3] != 0, new_slot, _normalised_into(o_ref),
                         scale=scale, block_k=block_k, group=group, exp2=exp2)


def _paged_append_kernel(bounds_ref, table_ref, qkv_ref, cos_ref, sin_ref, k_ref, v_ref, *refs, scale: float,
                         page_size: int, block_k: int, group: int, splits: int, exp2):
    """:func:`_step_with_new_token` over a paged cache: k_ref / v_ref (and their aliases) [P x page_size, D] (this KV
    head's pool, pages one after another), table_ref [M] (the row's pages), bounds_ref [4] int32 = (the row's filled
    slots before the step's, the page and the offset the step's key and value go to, unused). ``refs``: the output
    [N, D] (with ``splits`` > 1 this split's parts and running max / sum [N]), then the pool's aliases. With splits,
    program (row, head, s) reads the s-th of ``splits`` equal runs of the row's blocks; split 0 adds the step's own
    token; every split writes it (the same values)."""
    *outs, ko_ref, vo_ref = refs
    at = pl.ds(bounds_ref[1] * page_size + bounds_ref[2], 1)

    def new_slot(value):
        return (vo_ref if value else ko_ref).at[at, :]

    filled = bounds_ref[0]
    if splits == 1:
        lo, hi, first, store = 0, filled, True, _normalised_into(*outs)
    else:
        split = pl.program_id(2)
        per = pl.cdiv(pl.cdiv(filled, block_k), splits) * block_k
        lo, hi, first, store = split * per, jnp.minimum((split + 1) * per, filled), split == 0, _parts_into(*outs)
    blocks = _page_blocks(k_ref, v_ref, table_ref, page_size, block_k, read_dtype(qkv_ref.dtype, k_ref.dtype))
    _step_with_new_token(qkv_ref, cos_ref, sin_ref, outs[0].shape[0], blocks, lo, hi, first, new_slot, store,
                         scale=scale, block_k=block_k, group=group, exp2=exp2)


def _bounds(allowed: jax.Array) -> jax.Array:
    """[B, 2] int32: each row's first allowed slot and one past its last (0, 0 for a row with none)."""
    s = allowed.shape[1]
    any_ok = jnp.any(allowed, axis=1)
    first = jnp.argmax(allowed, axis=1)
    last = s - jnp.argmax(allowed[:, ::-1], axis=1)
    return jnp.where(any_ok[:, None], jnp.stack([first, last], axis=1), 0).astype(jnp.int32)


def call_unsupported(q: jax.Array, k: jax.Array) -> str | None:
    """Why this call cannot use the kernel (None when it can)."""
    g, d = q.shape[1] // k.shape[2], q.shape[2]
    if g > _MIN_ROWS:
        return f"{g} query heads per KV head (at most {_MIN_ROWS})"
    if d < 16 or d & (d - 1):
        return f"head_dim {d} is not a power of two >= 16"
    return None


def call_unsupported_append(q: jax.Array, k: jax.Array, cos: jax.Array) -> str | None:
    """Why this call cannot use the kernel with the step's rope and cache write (None when it can); ``q``
    [B, N, D] stands for the queries' shape."""
    d = q.shape[2]
    if cos.shape[-1] != d:
        return f"partial rotary ({cos.shape[-1]} of head_dim {d} rotate)"
    if d < 32:
        return f"head_dim {d} (rope's halves need at least 16 columns)"
    return call_unsupported(q, k)


def call_unsupported_paged_append(q: jax.Array, k_pages: jax.Array, cos: jax.Array) -> str | None:
    """Why a paged decode step with its rope and cache write cannot use the kernel (None when it can); ``q``
    [B, N, D] stands for the queries' shape, ``k_pages`` is [K, P, page_size, D]."""
    page = k_pages.shape[2]
    if page < 16 or page & (page - 1):
        return f"page_size {page} is not a power of two >= 16 (Triton's blocks)"
    return call_unsupported_append(q, k_pages.transpose(1, 2, 0, 3), cos)


def _interpreting(interpret: bool | None) -> bool:
    return jax.default_backend() not in ("gpu", "cuda") if interpret is None else interpret


def _params(num_warps: int, num_stages: int, interpret: bool) -> dict:
    return dict(compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
                interpret=interpret)


def _row_head_specs(n: int, s: int, d: int) -> tuple[pl.BlockSpec, pl.BlockSpec, pl.BlockSpec]:
    """Block specs of a (row, KV head) program: its row's queries [N, D], its head's cache [S, D], its row's
    allowed slots [S]."""
    return (pl.BlockSpec((None, n, d), lambda i, h: (i, 0, 0)),
            pl.BlockSpec((None, s, None, d), lambda i, h: (i, 0, h, 0)), pl.BlockSpec((None, s), lambda i, h: (i, 0)))


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "num_warps", "num_stages", "interpret"))
def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, *, scale: float,
                     block_k: int = 64, num_warps: int = 2, num_stages: int = 2,
                     interpret: bool | None = None) -> jax.Array:
    """See :func:`jrl.kernels.attention.api.decode_attention`. The default blocks (64 slots, 2 warps) measured
    fastest on an H100 at a 64-row sampler step (``benchmarks/decode_attention.py``): small enough for every
    program of the step to be resident at once."""
    b, n, d = q.shape
    s, kv = k.shape[1], k.shape[2]
    interpret = _interpreting(interpret)
    queries, cache, slots = _row_head_specs(n, s, d)
    return pl.pallas_call(
        functools.partial(_kernel, scale=scale, block_k=block_k, group=n // kv, exp2=_exp2(interpret)),
        grid=(b, kv),
        in_specs=[pl.BlockSpec((None, 2), lambda i, h: (i, 0)), queries, cache, cache, slots],
        out_specs=queries,
        out_shape=jax.ShapeDtypeStruct((b, n, d), v.dtype),
        name="jrl_decode_attention", **_params(num_warps, num_stages, interpret),
    )(_bounds(allowed), q, k, v, allowed.astype(jnp.int8))


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "num_warps", "num_stages", "interpret"))
def decode_attention_append(qkv, cos, sin, k_cache, v_cache, allowed, index, *, scale: float, block_k: int = 64,
                            num_warps: int = 2, num_stages: int = 2, interpret: bool | None = None):
    """See :func:`jrl.kernels.attention.api.decode_attention_append`: the step's rope, its cache write and the
    attention in one kernel (inside a jitted decoding loop the caches are updated in place). Blocks as
    :func:`decode_attention`."""
    b, s, kv, d = k_cache.shape
    n = qkv.shape[1] - 2 * kv
    interpret = _interpreting(interpret)
    index = jnp.asarray(index, jnp.int32)
    bounds = _bounds(allowed)
    new_ok = jax.lax.dynamic_index_in_dim(allowed, index, axis=1, keepdims=False)
    bounds = jnp.stack([bounds[:, 0], jnp.minimum(bounds[:, 1], index), jnp.broadcast_to(index, (b,)),
                        new_ok.astype(jnp.int32)], axis=1)
    queries, cache, slots = _row_head_specs(n, s, d)
    rope = pl.BlockSpec((None, d), lambda i, h: (i, 0))
    return pl.pallas_call(
        functools.partial(_append_kernel, scale=scale, block_k=block_k, group=n // kv, exp2=_exp2(interpret)),
        grid=(b, kv),
        in_specs=[pl.BlockSpec((None, 4), lambda i, h: (i, 0)),
                  pl.BlockSpec((None, n + 2 * kv, d), lambda i, h: (i, 0, 0)), rope, rope, cache, cache, slots],
        out_specs=[queries, cache, cache],
        out_shape=[jax.ShapeDtypeStruct((b, n, d), v_cache.dtype), jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                   jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)],
        input_output_aliases={4: 1, 5: 2},
        name="jrl_decode_attention_append", **_params(num_warps, num_stages, interpret),
    )(bounds, qkv, cos.astype(jnp.float32), sin.astype(jnp.float32), k_cache, v_cache, allowed.astype(jnp.int8))


def paged_blocks(pool_dtype) -> tuple[int, int]:
    """The paged kernel's default (``block_k``, ``num_warps``) for a pool of ``pool_dtype``: 64 slots on 2 warps for
    a bfloat16 pool, on one warp for a float8 pool, whose blocks are widened in registers (~200 per thread: one warp
    per program keeps the most programs resident and the most loads in flight). Fastest at every step width timed on
    an H200 (``benchmarks/decode_attention.py --paged``, 8 KV heads, float8 pool: 16 to 512 rows, 48-387 us per
    layer, 6-35% under the next best shape; ``benchmarks/RESULTS.md``)."""
    return (64, 1) if is_float8(pool_dtype) else (64, 2)


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "splits", "num_warps", "num_stages", "interpret"))
def paged_decode_attention_append(qkv, cos, sin, k_pages, v_pages, page_table, lengths, page, offset, *,
                                  scale: float, block_k: int | None = None, splits: int | None = None,
                                  num_warps: int | None = None, num_stages: int = 2, interpret: bool | None = None):
    """See :func:`jrl.kernels.attention.api.paged_decode_attention_append`: the step's rope, its write to the
    pool and the attention over the row's pages in one kernel (inside a jitted decoding loop the pools are updated
    in place). One program per (row, KV head, split); a block is ``block_k`` slots gathered through the table (any
    power-of-two page size: small pages do not make small matrix products). ``splits`` (None: from the table's
    width and the step's rows, :func:`split_count`) divides each row's blocks over that many programs, whose parts
    are combined after the kernel: a long row is read by several programs at once (the few long rows a long-tailed
    generation ends with would otherwise be read one block after another by one program per head). ``block_k`` and
    ``num_warps`` default to :func:`paged_blocks`."""
    kv, pool, page_size, d = k_pages.shape
    b, n = qkv.shape[0], qkv.shape[1] - 2 * kv
    interpret = _interpreting(interpret)
    default_block, default_warps = paged_blocks(k_pages.dtype)
    block_k, num_warps = block_k or default_block, num_warps or default_warps
    per_block = max(block_k // page_size, 1)  # the table padded to whole blocks
    page_table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, -page_table.shape[1] % per_block)))
    splits = split_count(page_table.shape[1] * page_size, block_k, b * kv) if splits is None else splits
    filled = jnp.maximum(jnp.asarray(lengths, jnp.int32) - 1, 0)
    bounds = jnp.stack([filled, jnp.asarray(page, jnp.int32), jnp.asarray(offset, jnp.int32),
                        jnp.zeros_like(filled)], axis=1)
    pages = pl.BlockSpec((None, pool * page_size, d), lambda i, h, s: (h, 0, 0))
    if splits == 1:
        out_specs = [pl.BlockSpec((None, n, d), lambda i, h, s: (i, 0, 0))]
        out_shape = [jax.ShapeDtypeStruct((b, n, d), qkv.dtype)]
    else:
        out_specs = [pl.BlockSpec((None, None, n, d), lambda i, h, s: (i, s, 0, 0))] + 2 * [
            pl.BlockSpec((None, None, n), lambda i, h, s: (i, s, 0))]
        out_shape = [jax.ShapeDtypeStruct((b, splits, n, d), jnp.float32)] + 2 * [
            jax.ShapeDtypeStruct((b, splits, n), jnp.float32)]
    rope = pl.BlockSpec((None, d), lambda i, h, s: (i, 0))
    flat = k_pages.reshape(kv, pool * page_size, d)  # each head's pages one after another (a free reshape)
    *outs, k_pages, v_pages = pl.pallas_call(
        functools.partial(_paged_append_kernel, scale=scale, page_size=page_size, block_k=block_k, group=n // kv,
                          splits=splits, exp2=_exp2(interpret)),
        grid=(b, kv, splits),
        in_specs=[pl.BlockSpec((None, 4), lambda i, h, s: (i, 0)),
                  pl.BlockSpec((None, page_table.shape[1]), lambda i, h, s: (i, 0)),
                  pl.BlockSpec((None, n + 2 * kv, d), lambda i, h, s: (i, 0, 0)), rope, rope, pages, pages],
        out_specs=out_specs + [pages, pages],
        out_shape=out_shape + 2 * [jax.ShapeDtypeStruct(flat.shape, flat.dtype)],
        input_output_aliases={5: len(out_shape), 6: len(out_shape) + 1},
        name="jrl_paged_decode_attention_append", **_params(num_warps, num_stages, interpret),
    )(bounds, page_table, qkv, cos.astype(jnp.float32), sin.astype(jnp.float32), flat, v_pages.reshape(flat.shape))
    out = outs[0] if splits == 1 else _combine_splits(*outs, qkv.dtype)
    return out, k_pages.reshape(kv, pool, page_size, d), v_pages.reshape(kv, pool, page_size, d)


_MOST_PROGRAMS = 16384
"""Programs of a paged decode step (rows x KV heads x splits) past which :func:`split_count` splits no further: each
program pays its own setup (the step's rope, its first block's loads in sequence), and once a step's rows alone
fill the GPU, more splits cost more than the balance they buy (H200, 8 KV heads, float8 pool: 512 rows of ~1,900
slots 439 us per layer at 4 splits, 448 at 8, 472 at 2; 256 rows of ~2,700 slots 320 us at 8, 333 at 4;
``benchmarks/RESULTS.md``)."""

_FEW_ROW_PROGRAMS = 4096
"""Programs a step of few rows (a long generation's tail) is split into when the rule for wide steps gives fewer:
shorter splits of the long rows, down to :data:`_FEW_ROW_BLOCKS` blocks of a full-width row (H200, float8 pool,
8 KV heads, rows of ~3,900 slots in a table of 8,448: 16 rows 43.2 us per layer at 32 splits against 47.2 at 8,
32 rows 63.0 at 16 against 65.1; ``benchmarks/RESULTS.md``)."""
_FEW_ROW_BLOCKS = 4


def _doublings(width: int, slots_per_split: int, row_heads: int, most: int, programs: int) -> int:
    """The most splits, a power of two up to ``most``, that leave each at least ``slots_per_split`` slots of a
    ``width``-slot row and the step at most ``programs`` programs."""
    splits = 1
    while 2 * splits <= most and 2 * splits * slots_per_split <= width and 2 * splits * row_heads <= programs:
        splits *= 2
    return splits


def split_count(width: int, block_k: int, row_heads: int = 1, *, blocks_per_split: int = 16, most: int = 8) -> int:
    """Programs per (row, KV head) of :func:`paged_decode_attention_append` for a page table of ``width`` slots and a
    step of ``row_heads`` rows x KV heads: a power of two, at most ``most``, each split holding at least
    ``blocks_per_split`` blocks of a full-width row (short tables: one program, no combination step), and the step
    at most :data:`_MOST_PROGRAMS` programs; or, where that leaves a step of few rows under
    :data:`_FEW_ROW_PROGRAMS` programs, splits of :data:`_FEW_ROW_BLOCKS` blocks up to that many programs."""
    wide = _doublings(width, blocks_per_split * block_k, row_heads, most, _MOST_PROGRAMS)
    few = _doublings(width, _FEW_ROW_BLOCKS * block_k, row_heads, 4 * most, _FEW_ROW_PROGRAMS)
    return max(wide, few)
