"""Decode attention through a page table against a dense cache on fresh random inputs: rows of every length (1,
a page boundary, the whole table), shared prompt pages, pages in random order with holes between them, GQA and
multi-head. The reference is checked against :func:`decode_attention` over the dense cache the pages were cut
from; ``pallas_gpu`` (JAX's Pallas paged attention) against the reference, in interpret mode on CPU and compiled
on a GPU (``-m gpu``); ``pallas_tpu`` (bfloat16 only) in Pallas TPU interpret mode. The step with its rope and
page write (``paged_decode_attention_append``): the fused ``pallas_gpu`` kernel against rope, write and reference
attention in plain JAX, output and both pools, on pools of the queries' dtype and on float8 pools."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels.attention import (decode_attention, paged_decode_attention, paged_decode_attention_append,
                                   stored_as)
from kernels_testlib import assert_close, assert_step_close, lower_for, rng_for


def _paged(rng, b: int, m: int, page: int, kv: int, g: int, d: int, dtype):
    """Queries, a dense cache [B, M * page, K, D] with each row's lengths, and the same cache as a page pool in
    random order (pool larger than needed; rows 0 and 1 share their first page, as two completions of one prompt
    share their prompt's pages)."""
    s = m * page
    lengths = rng.integers(1, s + 1, b)
    lengths[:4] = [1, page, s, page + 1][:min(b, 4)]
    q = jnp.asarray(rng.standard_normal((b, kv * g, d)), dtype)
    dense_k = rng.standard_normal((b, s, kv, d)).astype(np.float32)
    dense_v = rng.standard_normal((b, s, kv, d)).astype(np.float32)
    dense_k[1, :page], dense_v[1, :page] = dense_k[0, :page], dense_v[0, :page]
    pool = b * m + 7
    order = rng.permutation(pool)
    table = order[:b * m].reshape(b, m)
    table[1, 0] = table[0, 0]
    k_pages = rng.standard_normal((kv, pool, page, d)).astype(np.float32)  # unused pages hold junk
    v_pages = rng.standard_normal((kv, pool, page, d)).astype(np.float32)
    for r in range(b):
        for j in range(m):
            k_pages[:, table[r, j]] = dense_k[r, j * page:(j + 1) * page].transpose(1, 0, 2)
            v_pages[:, table[r, j]] = dense_v[r, j * page:(j + 1) * page].transpose(1, 0, 2)
    cast = (lambda x: jnp.asarray(x, dtype))
    return (q, cast(dense_k), cast(dense_v), cast(k_pages), cast(v_pages), jnp.asarray(table, jnp.int32),
            jnp.asarray(lengths, jnp.int32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kv,g,m,page", [(2, 4, 6, 16), (1, 8, 3, 32), (3, 1, 16, 16)])
def test_paged_reference_and_kernel_match_the_dense_cache(request, dtype, kv, g, m, page):
    rng = rng_for(request)
    q, dk, dv, kp, vp, table, lengths = _paged(rng, 6, m, page, kv, g, 16, dtype)
    allowed = jnp.arange(dk.shape[1])[None, :] < lengths[:, None]
    dense = decode_attention(q, dk, dv, allowed, impl="reference")
    ref = paged_decode_attention(q, kp, vp, table, lengths, impl="reference")
    assert_close(ref, dense, dtype, f"paged reference kv={kv} g={g} m={m}")
    out = paged_decode_attention(q, kp, vp, table, lengths, impl="pallas_gpu", interpret=True)
    assert out.dtype == vp.dtype and out.shape == q.shape and np.isfinite(np.asarray(out, np.float32)).all()
    assert_close(out, ref, dtype, f"paged kernel kv={kv} g={g} m={m}")


@pytest.mark.parametrize("kv,g,m", [(2, 4, 4), (1, 2, 6)])
def test_tpu_kernel_in_interpret_mode_matches_the_reference_in_bfloat16(request, kv, g, m):
    rng = rng_for(request)
    q, _, _, kp, vp, table, lengths = _paged(rng, 4, m, 16, kv, g, 128, jnp.bfloat16)
    ref = paged_decode_attention(q, kp, vp, table, lengths, impl="reference")
    out = paged_decode_attention(q, kp, vp, table, lengths, impl="pallas_tpu", interpret=True)
    assert out.dtype == jnp.bfloat16 and np.isfinite(np.asarray(out, np.float32)).all()
    assert_close(out, ref, jnp.bfloat16, f"TPU paged kernel kv={kv} g={g} m={m}")
    with pytest.raises(Exception, match=r"pallas_tpu.*dtype float32"):
        paged_decode_attention(q.astype(jnp.float32), kp.astype(jnp.float32), vp.astype(jnp.float32), table,
                               lengths, impl="pallas_tpu")


def test_a_sliding_window_reads_a_rows_last_slots_on_the_reference(request):
    rng = rng_for(request)
    q, dk, dv, kp, vp, table, lengths = _paged(rng, 6, 4, 16, 2, 2, 16, jnp.float32)
    slots = jnp.arange(dk.shape[1])[None, :]
    allowed = (slots < lengths[:, None]) & (slots >= lengths[:, None] - 5)
    dense = decode_attention(q, dk, dv, allowed, impl="reference")
    assert_close(paged_decode_attention(q, kp, vp, table, lengths, window=5), dense, jnp.float32, "window 5")
    whole = paged_decode_attention(q, kp, vp, table, lengths)
    assert np.abs(np.asarray(whole) - np.asarray(dense)).max() > 1e-3  # the window changes rows longer than 5
    with pytest.raises(Exception, match=r"pallas_gpu.*sliding window"):
        paged_decode_attention(q, kp, vp, table, lengths, window=5, impl="pallas_gpu")


def test_a_row_of_length_zero_stays_finite_and_bad_shapes_are_named(request):
    rng = rng_for(request)
    q, _, _, kp, vp, table, lengths = _paged(rng, 4, 2, 16, 2, 2, 16, jnp.float32)
    lengths = lengths.at[3].set(0)
    for impl in ("reference", "pallas_gpu"):
        out = paged_decode_attention(q, kp, vp, table, lengths, impl=impl)
        assert np.isfinite(np.asarray(out)).all(), impl
    with pytest.raises(ValueError, match=r"page_table \[B, M\] and lengths \[B\]"):
        paged_decode_attention(q, kp, vp, table[:2], lengths)
    with pytest.raises(Exception, match=r"head_dim 8 and page_size 16 must be multiples of 16"):
        paged_decode_attention(q[..., :8], kp[..., :8], vp[..., :8], table, lengths, impl="pallas_gpu")


def test_the_gpu_kernels_table_is_padded_to_power_of_two_blocks():
    from jrl.kernels.attention.paged_pallas_gpu import _layout

    for pages in (1, 3, 5, 16, 17, 80, 100, 528):
        splits, block, width = _layout(pages)
        assert block & (block - 1) == 0 and splits & (splits - 1) == 0 and block <= 8 and splits <= 16, pages
        assert width >= pages and width % (splits * block) == 0 and width < pages + splits * block, pages
        assert splits * block <= max(pages, block), pages  # every split holds a whole block of real pages


def _append_inputs(rng, b: int, m: int, page: int, kv: int, g: int, d: int, dtype):
    """:func:`_paged`'s pool and table with a step to write: row b's new key and value go to its slot
    ``lengths[b] - 1`` (rows 0 and 1, which share their first page, write past it: no row writes a page another
    reads), except the last row's, which go to a scratch page of their own (its output is unspecified). Rope of
    random positions (rotate_half layout). Returns (qkv, cos, sin, k_pages, v_pages, table, lengths, page, offset)."""
    q, _, _, kp, vp, table, lengths = _paged(rng, b, m, page, kv, g, d, dtype)
    lengths = np.asarray(lengths).copy()
    lengths[0], lengths[1] = page + 1, min(2 * page, m * page)
    table = np.asarray(table)
    slot = lengths - 1
    pages, offsets = table[np.arange(b), slot // page], slot % page
    pages[-1], offsets[-1] = np.setdiff1d(np.arange(kp.shape[1]), table)[0], 3  # a page in no table
    inv = 1.0 / 10000.0 ** (np.arange(0, d, 2) / d)
    angles = rng.integers(0, 4 * m * page, (b, 1)) * inv
    angles = np.concatenate([angles, angles], axis=1)
    qkv = jnp.asarray(rng.standard_normal((b, kv * g + 2 * kv, d)), dtype)
    i32 = (lambda x: jnp.asarray(x, jnp.int32))
    return (qkv, jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32), kp, vp,
            i32(table), i32(lengths), i32(pages), i32(offsets))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kv,g,m,page,d,splits,block_k", [(2, 4, 6, 16, 32, None, 64), (1, 8, 3, 32, 64, None, 64),
                                                          (3, 1, 5, 16, 32, None, 64), (2, 4, 9, 16, 32, 3, 64),
                                                          (1, 2, 12, 16, 64, 2, 64), (2, 4, 5, 32, 32, 2, 16),
                                                          (1, 4, 7, 16, 64, None, 32)])
def test_paged_append_kernel_matches_rope_write_and_reference_attention(request, dtype, kv, g, m, page, d, splits,
                                                                        block_k):
    """The fused kernel (interpret mode), each row's blocks read by one program or split over several (some
    splits empty for short rows), blocks of several pages or of part of one, against the rope, the write and the
    reference attention."""
    inputs = _append_inputs(rng_for(request), 6, m, page, kv, g, d, dtype)
    ref = paged_decode_attention_append(*inputs, impl="reference")
    assert not np.array_equal(np.asarray(ref[1], np.float32), np.asarray(inputs[3], np.float32))  # it wrote
    out = paged_decode_attention_append(*inputs, impl="pallas_gpu", interpret=True, splits=splits, block_k=block_k)
    assert_step_close(out, ref, dtype, f"paged append kv={kv} g={g} m={m} page={page} splits={splits} "
                                       f"block_k={block_k}")


F8 = jnp.float8_e4m3fn


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("splits,block_k", [(None, None), (3, None), (None, 64)])
def test_a_float8_pool_is_widened_on_read_and_clipped_on_write(request, dtype, splits, block_k):
    """A float8 pool (``rollout.kv.dtype``): the reference reads it as the same pool widened to float16 under float16
    queries (the output in the queries' dtype), stores the step's keys and values clipped to the type's range (values
    of 1000 become 448, not NaN), and the fused kernel (interpret mode) matches it: the output to float16's tolerance
    (bfloat16's under bfloat16 queries), the values exactly, the keys to one float8 rounding where rope's float32
    arithmetic rounds differently."""
    qkv, cos, sin, kp, vp, table, lengths, page, offset = _append_inputs(rng_for(request), 6, 9, 16, 2, 4, 32, dtype)
    kv = kp.shape[0]
    qkv = qkv.at[:, -kv:, :3].set(1000.0)  # the step's values past float8's range
    kp8, vp8 = stored_as((kp * 30).at[:, :, 0, 0].set(-1000.0), F8), stored_as(vp, F8)  # keys of ~30, some past it
    assert kp8.dtype == F8 and float(jnp.max(jnp.abs(kp8.astype(jnp.float32)))) == 448.0
    q = qkv[:, :-2 * kv]
    f16 = jnp.float16
    widened = paged_decode_attention(q.astype(f16), kp8.astype(f16), vp8.astype(f16), table, lengths,
                                     impl="reference")
    assert np.array_equal(np.asarray(paged_decode_attention(q, kp8, vp8, table, lengths, impl="reference")),
                          np.asarray(widened.astype(dtype)))
    ref = paged_decode_attention_append(qkv, cos, sin, kp8, vp8, table, lengths, page, offset, impl="reference")
    written = np.asarray(ref[2][:, np.asarray(page), np.asarray(offset)], np.float32)  # [K, B, D]
    assert ref[0].dtype == dtype and ref[1].dtype == ref[2].dtype == F8
    assert (written[..., :3] == 448.0).all() and np.isfinite(np.asarray(ref[1], np.float32)).all()
    out = paged_decode_attention_append(qkv, cos, sin, kp8, vp8, table, lengths, page, offset, impl="pallas_gpu",
                                        interpret=True, splits=splits, block_k=block_k)
    assert all(o.dtype == r.dtype for o, r in zip(out, ref)) and np.isfinite(np.asarray(out[0], np.float32)).all()
    # Both read in float16: the tolerance of the coarser of float16 and the queries' dtype.
    assert_close(out[0][:-1], ref[0][:-1], dtype, f"float8 pool, splits={splits}: output",
                 tol=1e-2 if dtype == jnp.bfloat16 else 1e-3)
    assert_close(out[1], ref[1], jnp.bfloat16, f"float8 pool, splits={splits}: keys", tol=2e-2)
    assert_close(out[2], ref[2], dtype, f"float8 pool, splits={splits}: values", tol=0.0)


def test_a_float8_pools_blocks_take_one_warp_and_a_bfloat16_pools_two():
    """``paged_blocks``: 64-slot blocks, on 2 warps for a bfloat16 pool and one for a float8 pool; the kernel's
    defaults follow it, and the float8 shape lowers for a GPU at a narrow and a wide step."""
    from jrl.kernels.attention import decode_pallas_gpu

    assert decode_pallas_gpu.paged_blocks(jnp.bfloat16) == (64, 2)
    assert decode_pallas_gpu.paged_blocks(F8) == (64, 1)
    kv, d = 8, 64
    for rows in (16, 512):
        qkv, rope = jnp.zeros((rows, 6 * kv, d), jnp.bfloat16), jnp.zeros((rows, d), jnp.float32)
        pool, ints = jnp.zeros((kv, 64, 16, d), F8), jnp.zeros((rows,), jnp.int32)
        text = lower_for("cuda", lambda *a: decode_pallas_gpu.paged_decode_attention_append(
            *a, scale=0.1, interpret=False), qkv, rope, rope, pool, pool, jnp.zeros((rows, 8), jnp.int32), ints,
            ints, ints)
        assert "num_warps = 1 " in text, rows


def test_jaxs_paged_kernels_refuse_a_float8_pool_and_auto_reads_it_on_the_reference(request, monkeypatch):
    from jrl.kernels import _dispatch

    q, _, _, kp, vp, table, lengths = _paged(rng_for(request), 4, 3, 16, 2, 2, 16, jnp.bfloat16)
    kp8, vp8 = stored_as(kp, F8), stored_as(vp, F8)
    with pytest.raises(Exception, match=r"pallas_gpu.*float8_e4m3fn pool under bfloat16 queries"):
        paged_decode_attention(q, kp8, vp8, table, lengths, impl="pallas_gpu", interpret=True)
    ref = paged_decode_attention(q, kp8, vp8, table, lengths, impl="reference")
    monkeypatch.setattr(_dispatch, "backend", lambda: "gpu")
    assert np.array_equal(np.asarray(paged_decode_attention(q, kp8, vp8, table, lengths)), np.asarray(ref))


def test_long_tables_split_each_row_over_several_programs():
    from jrl.kernels.attention.decode_pallas_gpu import split_count

    assert split_count(384, 64) == 1  # a short table: one program per (row, head), no combination
    assert split_count(2048, 64, 512 * 8) == 2
    assert split_count(8464, 64, 256 * 8) == 8  # 8192 new tokens after a 256-token prompt
    assert split_count(1 << 20, 64, 256 * 8) == 8
    # a step of few rows (a long generation's tail) splits its rows further, up to 4,096 programs
    assert split_count(8464, 64, 16 * 8) == 32
    assert split_count(8464, 64, 32 * 8) == 16
    assert split_count(8464, 64, 128 * 8) == 8  # the wide steps' rule gives more
    assert split_count(2048, 64, 16 * 8) == 8  # splits of at least 4 blocks of a full-width row
    # a step whose rows fill the GPU on their own splits less (at most 16,384 programs)
    assert split_count(8464, 64, 512 * 8) == 4
    assert split_count(8464, 64, 2048 * 8) == 1


def test_paged_append_refusals_are_named_and_auto_falls_back(request):
    qkv, cos, sin, kp, vp, table, lengths, page, offset = _append_inputs(rng_for(request), 4, 3, 16, 2, 2, 32,
                                                                         jnp.float32)
    ref = paged_decode_attention_append(qkv, cos, sin, kp, vp, table, lengths, page, offset, impl="reference",
                                        window=5)
    auto = paged_decode_attention_append(qkv, cos, sin, kp, vp, table, lengths, page, offset, window=5)
    assert_step_close(auto, ref, jnp.float32, "auto with a window")
    with pytest.raises(Exception, match=r"pallas_gpu.*sliding window"):
        paged_decode_attention_append(qkv, cos, sin, kp, vp, table, lengths, page, offset, impl="pallas_gpu",
                                      window=5)
    with pytest.raises(Exception, match=r"partial rotary"):
        paged_decode_attention_append(qkv, cos[:, :16], sin[:, :16], kp, vp, table, lengths, page, offset,
                                      impl="pallas_gpu")
    with pytest.raises(ValueError, match=r"page = offset \[B\]"):
        paged_decode_attention_append(qkv, cos, sin, kp, vp, table, lengths, page[:2], offset)


def test_auto_on_a_gpu_takes_the_fused_paged_kernel(request, monkeypatch):
    """impl='auto' on a GPU backend runs the fused kernel (here in interpret mode), not the rope, write and read
    apart (the first measured paged sampler fell back to them on every step)."""
    from jrl.kernels import _dispatch
    from jrl.kernels.attention import decode_pallas_gpu

    calls = []
    fused = decode_pallas_gpu.paged_decode_attention_append

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return fused(*args, **kwargs)

    inputs = _append_inputs(rng_for(request), 4, 6, 16, 2, 2, 32, jnp.float32)
    ref = paged_decode_attention_append(*inputs, impl="reference")
    monkeypatch.setattr(_dispatch, "backend", lambda: "gpu")
    monkeypatch.setattr(decode_pallas_gpu, "paged_decode_attention_append", spy)
    out = paged_decode_attention_append(*inputs)
    assert calls == [inputs[0].shape]
    assert_step_close(out, ref, jnp.float32, "auto on a gpu backend")


@pytest.mark.parametrize("m,page", [(5, 16), (80, 16), (528, 16), (33, 32)])
def test_the_gpu_kernels_lower_for_cuda_at_any_table_width(m, page):
    """The Triton lowering of both GPU paged kernels at table widths that are not powers of two (the first GPU run
    of the paged sampler failed there: pages per row split into blocks of 3 and 5)."""
    from jrl.kernels.attention import decode_pallas_gpu, paged_pallas_gpu

    b, kv, g, d = 4, 8, 4, 64
    q, qkv = jnp.zeros((b, kv * g, d), jnp.bfloat16), jnp.zeros((b, kv * g + 2 * kv, d), jnp.bfloat16)
    pool, rope = jnp.zeros((kv, 2 * m, page, d), jnp.bfloat16), jnp.zeros((b, d), jnp.float32)
    table, rows = jnp.zeros((b, m), jnp.int32), jnp.ones((b,), jnp.int32)
    read = lower_for("cuda", lambda *a: paged_pallas_gpu.paged_decode_attention(*a, scale=0.1, interpret=False),
                     q, pool, pool, table, rows)
    for splits in (1, 4):
        fused = lower_for("cuda", lambda *a: decode_pallas_gpu.paged_decode_attention_append(
            *a, scale=0.1, splits=splits, interpret=False), qkv, rope, rope, pool, pool, table, rows, rows, rows)
        assert "jrl_paged_decode_attention_append" in fused
        assert "ex2.approx" in fused  # the softmax on the GPU's exp2 instruction, not libdevice's accurate exp
    assert "triton" in read.lower()


def test_the_tpu_kernel_lowers_for_tpu():
    from jrl.kernels.attention import paged_pallas_tpu

    q, pool = jnp.zeros((8, 32, 128), jnp.bfloat16), jnp.zeros((8, 64, 16, 128), jnp.bfloat16)
    text = lower_for("tpu", lambda *a: paged_pallas_tpu.paged_decode_attention(*a, scale=0.1, interpret=False),
                     q, pool, pool, jnp.zeros((8, 5), jnp.int32), jnp.ones((8,), jnp.int32))
    assert "tpu_custom_call" in text


@pytest.mark.gpu
@pytest.mark.parametrize("m,splits", [(64, None), (5, None), (64, 4), (300, None)])
def test_gpu_paged_append_kernel_matches_reference(request, m, splits):
    inputs = _append_inputs(rng_for(request), 16, m, 16, 8, 4, 64, jnp.bfloat16)
    assert_step_close(paged_decode_attention_append(*inputs, impl="pallas_gpu", splits=splits),
                      paged_decode_attention_append(*inputs, impl="reference"), jnp.bfloat16,
                      f"compiled paged append, {m} pages per row, splits={splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("rows,splits", [(16, None), (16, 4), (160, None)])
def test_gpu_paged_append_kernel_on_a_float8_pool_matches_reference(request, rows, splits):
    """16 and 160 rows of 8 KV heads on the defaults' 64-slot blocks and one warp (``paged_blocks``), with the
    splits the defaults pick and with four."""
    qkv, cos, sin, kp, vp, table, lengths, page, offset = _append_inputs(rng_for(request), rows, 64, 16, 8, 4, 64,
                                                                         jnp.bfloat16)
    inputs = (qkv, cos, sin, stored_as(kp, F8), stored_as(vp, F8), table, lengths, page, offset)
    out = paged_decode_attention_append(*inputs, impl="pallas_gpu", splits=splits)
    ref = paged_decode_attention_append(*inputs, impl="reference")
    assert all(o.dtype == r.dtype for o, r in zip(out, ref)) and out[1].dtype == F8
    assert_close(out[0][:-1], ref[0][:-1], jnp.bfloat16, f"compiled, float8 pool, splits={splits}: output")
    assert_close(out[1], ref[1], jnp.bfloat16, f"compiled, float8 pool, splits={splits}: keys", tol=2e-2)
    assert_close(out[2], ref[2], jnp.bfloat16, f"compiled, float8 pool, splits={splits}: values", tol=0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [64, 5, 80])
def test_gpu_paged_kernel_matches_reference(request, m):
    rng = rng_for(request)
    q, _, _, kp, vp, table, lengths = _paged(rng, 16, m, 16, 8, 4, 64, jnp.bfloat16)
    ref = paged_decode_attention(q, kp, vp, table, lengths, impl="reference")
    assert_close(paged_decode_attention(q, kp, vp, table, lengths, impl="pallas_gpu"), ref, jnp.bfloat16,
                 f"compiled paged kernel, {m} pages per row")
