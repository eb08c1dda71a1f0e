"""Decode attention (one query per row over a KV cache) against the dense reference on fresh random inputs:
left padding, a partly filled cache, a row with holes (a stopped row), a single allowed slot, GQA and
multi-head, block sizes that do not divide the cache; and the same step with its rope and cache write
(``decode_attention_append``): output and both updated caches. CPU: ``pallas_gpu`` in Pallas interpret mode.
GPU (``-m gpu``): the compiled kernels in bf16 at a sampler's shape."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels.attention import decode_attention, decode_attention_append
from kernels_testlib import assert_close, assert_step_close, lower_for, rng_for


def _allowed(rng, b: int, s: int) -> np.ndarray:
    """[B, S] bool: row 0 left padding then a filled prefix of the cache, row 1 every slot, row 2 with holes,
    row 3 one slot, the rest random contiguous runs."""
    allowed = np.zeros((b, s), bool)
    pad, filled = int(rng.integers(1, s // 4)), int(rng.integers(s // 2, s))
    allowed[0, pad:filled] = True
    allowed[1] = True
    allowed[2, int(rng.integers(0, s // 4)):int(rng.integers(s // 2, s))] = True
    allowed[2, rng.choice(s, size=s // 8, replace=False)] = False
    allowed[2, s // 2] = True
    allowed[3, int(rng.integers(0, s))] = True
    for r in range(4, b):
        lo = int(rng.integers(0, s - 1))
        allowed[r, lo:int(rng.integers(lo + 1, s + 1))] = True
    return allowed


def _inputs(rng, b, s, kv, g, d, dtype):
    q = jnp.asarray(rng.standard_normal((b, kv * g, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, s, kv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, s, kv, d)), dtype)
    return q, k, v, jnp.asarray(_allowed(rng, b, s))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kv,g,s,block_k", [(2, 4, 100, 32), (3, 1, 48, 16), (1, 8, 70, 64)])
def test_pallas_interpret_matches_reference(request, dtype, kv, g, s, block_k):
    rng = rng_for(request)
    q, k, v, allowed = _inputs(rng, 6, s, kv, g, 16, dtype)
    ref = decode_attention(q, k, v, allowed, impl="reference")
    out = decode_attention(q, k, v, allowed, impl="pallas_gpu", block_k=block_k, interpret=True)
    assert out.dtype == v.dtype and out.shape == q.shape
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert_close(out, ref, dtype, f"decode attention kv={kv} g={g} s={s}")


def test_a_row_with_no_allowed_slot_stays_finite(request):
    rng = rng_for(request)
    q, k, v, allowed = _inputs(rng, 5, 40, 2, 2, 16, jnp.float32)
    allowed = allowed.at[4].set(False)
    out = decode_attention(q, k, v, allowed, impl="pallas_gpu", block_k=16, interpret=True)
    assert np.isfinite(np.asarray(out)).all()
    ref = decode_attention(q, k, v, allowed, impl="reference")
    assert_close(out[:4], ref[:4], jnp.float32, "rows with allowed slots")


def test_unsupported_shapes_fall_back_or_name_the_reason():
    q, k = jnp.ones((2, 4, 8)), jnp.ones((2, 10, 2, 8))
    allowed = jnp.ones((2, 10), bool)
    with pytest.raises(RuntimeError, match="head_dim 8 is not a power of two"):
        decode_attention(q, k, k, allowed, impl="pallas_gpu")
    assert_close(decode_attention(q, k, k, allowed), decode_attention(q, k, k, allowed, impl="reference"),
                 jnp.float32, "auto")


def test_shape_errors_name_the_inputs():
    q = jnp.zeros((2, 4, 8))
    k = jnp.zeros((2, 10, 3, 8))
    with pytest.raises(ValueError, match="N % K == 0"):
        decode_attention(q, k, k, jnp.ones((2, 10), bool))
    with pytest.raises(ValueError, match="allowed is for"):
        decode_attention(q, k[:, :, :2], k[:, :, :2], jnp.ones((2, 9), bool))


def _append_inputs(rng, b, s, kv, g, d, dtype):
    """A step at slot ``index`` = 3/4 of the cache: rows as :func:`_allowed` cut at that slot (each but row 3
    and the last also allowing the step's slot, the last row allowing nothing), rope of random positions."""
    index = 3 * s // 4
    allowed = _allowed(rng, b, s)
    allowed[:, index + 1:] = False
    allowed[:, index] = True
    allowed[3, :] = False
    allowed[3, int(rng.integers(0, index))] = True
    allowed[-1] = False
    inv = 1.0 / 10000.0 ** (np.arange(0, d, 2) / d)
    angles = rng.integers(0, 4 * s, (b, 1)) * inv
    angles = np.concatenate([angles, angles], axis=1)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    return (normal(b, kv * g + 2 * kv, d), jnp.asarray(np.cos(angles), jnp.float32),
            jnp.asarray(np.sin(angles), jnp.float32), normal(b, s, kv, d), normal(b, s, kv, d),
            jnp.asarray(allowed), index)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kv,g,s,d,block_k", [(2, 4, 100, 32, 32), (3, 1, 48, 64, 16), (1, 8, 70, 32, 64)])
def test_append_interpret_matches_reference(request, dtype, kv, g, s, d, block_k):
    inputs = _append_inputs(rng_for(request), 6, s, kv, g, d, dtype)
    ref = decode_attention_append(*inputs, impl="reference")
    out = decode_attention_append(*inputs, impl="pallas_gpu", block_k=block_k, interpret=True)
    assert_step_close(out, ref, dtype, f"append kv={kv} g={g} s={s} d={d}")


def test_append_unsupported_shapes_fall_back_or_name_the_reason(request):
    qkv, cos, sin, k_cache, v_cache, allowed, index = _append_inputs(rng_for(request), 5, 40, 2, 2, 32, jnp.float32)
    partial = (cos[:, :16], sin[:, :16])
    with pytest.raises(RuntimeError, match="partial rotary"):
        decode_attention_append(qkv, *partial, k_cache, v_cache, allowed, index, impl="pallas_gpu")
    auto = decode_attention_append(qkv, *partial, k_cache, v_cache, allowed, index)
    ref = decode_attention_append(qkv, *partial, k_cache, v_cache, allowed, index, impl="reference")
    assert_step_close(auto, ref, jnp.float32, "auto, partial rotary")
    with pytest.raises(ValueError, match=r"qkv \[B, N \+ 2K, D\]"):
        decode_attention_append(qkv[:, :5], cos, sin, k_cache, v_cache, allowed, index)


@pytest.mark.gpu
def test_gpu_append_kernel_matches_reference(request):
    inputs = _append_inputs(rng_for(request), 64, 384, 8, 4, 64, jnp.bfloat16)
    assert_step_close(decode_attention_append(*inputs, impl="pallas_gpu"),
                         decode_attention_append(*inputs, impl="reference"), jnp.bfloat16, "compiled append")


@pytest.mark.gpu
def test_gpu_kernel_matches_reference(request):
    rng = rng_for(request)
    q, k, v, allowed = _inputs(rng, 64, 384, 8, 4, 64, jnp.bfloat16)
    ref = decode_attention(q, k, v, allowed, impl="reference")
    out = decode_attention(q, k, v, allowed, impl="pallas_gpu")
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert_close(out, ref, jnp.bfloat16, "compiled decode attention")


@pytest.mark.parametrize("rows,slots", [(64, 384), (5, 1100)])
def test_the_kernels_lower_for_cuda(rows, slots):
    """Both kernels' Triton lowering at a sampler's shapes (runs on CPU; compiling the result needs a GPU)."""
    from jrl.kernels.attention import decode_pallas_gpu

    kv, g, d = 8, 4, 64
    q, qkv = jnp.zeros((rows, kv * g, d), jnp.bfloat16), jnp.zeros((rows, kv * g + 2 * kv, d), jnp.bfloat16)
    cache, rope = jnp.zeros((rows, slots, kv, d), jnp.bfloat16), jnp.zeros((rows, d), jnp.float32)
    allowed = jnp.ones((rows, slots), bool)
    read = lower_for("cuda", lambda *a: decode_pallas_gpu.decode_attention(*a, scale=0.1, interpret=False),
                     q, cache, cache, allowed)
    step = lower_for("cuda", lambda *a: decode_pallas_gpu.decode_attention_append(*a, 7, scale=0.1, interpret=False),
                     qkv, rope, rope, cache, cache, allowed)
    assert "jrl_decode_attention" in read and "jrl_decode_attention_append" in step
