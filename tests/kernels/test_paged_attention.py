"""Decode attention through a page table against a dense cache on fresh random inputs: rows of every length (1,
a page boundary, the whole table), shared prompt pages, pages in random order with holes between them, GQA and
multi-head. The reference is checked against :func:`decode_attention` over the dense cache the pages were cut
from; ``pallas_gpu`` (JAX's Pallas paged attention) against the reference, in interpret mode on CPU and compiled
on a GPU (``-m gpu``); ``pallas_tpu`` (bfloat16 only) in Pallas TPU interpret mode."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels.attention import decode_attention, paged_decode_attention
from kernels_testlib import assert_close, rng_for


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


@pytest.mark.gpu
def test_gpu_paged_kernel_matches_reference(request):
    rng = rng_for(request)
    q, _, _, kp, vp, table, lengths = _paged(rng, 64, 64, 16, 8, 4, 64, jnp.bfloat16)
    ref = paged_decode_attention(q, kp, vp, table, lengths, impl="reference")
    assert_close(paged_decode_attention(q, kp, vp, table, lengths, impl="pallas_gpu"), ref, jnp.bfloat16,
                 "compiled paged kernel")
