"""Attention implementations against the dense reference on fresh random inputs: left and right padding,
packed segments, GQA, sliding window and an explicit (strided EBFT) mask; outputs and gradients of q, k, v.

CPU: ``reference`` against a NumPy loop, ``xla`` (blocked, with block sizes that do not divide the rows),
``splash`` in Pallas interpret mode, the model's ``auto`` pick for long rows (an 8192-token forward +
backward of a small model). GPU (``-m gpu``): ``cudnn`` and ``xla`` on the device in bf16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels.attention import DENSE_MAX_SCORES, AttentionMask, attention
from jrl.kernels.attention.mask import segment_runs
from jrl.models import strided as st
from kernels_testlib import assert_close, rng_for


def _inputs(rng, b, t, n, k, d, dtype):
    q = jnp.asarray(rng.standard_normal((b, t, n, d)), dtype)
    kk = jnp.asarray(rng.standard_normal((b, t, k, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, t, k, d)), dtype)
    dout = jnp.asarray(rng.standard_normal((b, t, n, d)), jnp.float32)
    return q, kk, v, dout


def _padded_rows(rng, b, t):
    """[B, T] int32 attention masks: one left-padded row, one right-padded, one with both, the rest full."""
    m = np.ones((b, t), np.int32)
    m[0, : int(rng.integers(1, t // 2))] = 0
    if b > 1:
        m[1, int(rng.integers(t // 2, t - 1)):] = 0
    if b > 2:
        m[2, : int(rng.integers(1, t // 4))] = 0
        m[2, int(rng.integers(t // 2, t - 1)):] = 0
    return jnp.asarray(m)


def _packed_rows(rng, b, t):
    """[B, T] segment ids (documents of random lengths) and a padding mask with a padded tail."""
    seg = np.zeros((b, t), np.int32)
    for r in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t), size=3, replace=False))
        seg[r] = np.searchsorted(cuts, np.arange(t), side="right")
    pad = np.ones((b, t), np.int32)
    pad[:, t - int(rng.integers(1, t // 4)):] = 0
    return jnp.asarray(seg), jnp.asarray(pad)


def _strided_mask(rng, b):
    seq_len, c, g = 24, 4, 3
    anchor = st.anchors(st.first_anchors(c, batch=b), st.num_blocks(seq_len, c, 5, g), 5)
    return AttentionMask.from_dense(st.strided_mask(seq_len, anchor, c, g, sliding_window=9))


def _masks(rng, b, t):
    seg, pad = _packed_rows(rng, b, t)
    return {
        "padded": AttentionMask.padded(_padded_rows(rng, b, t)),
        "padded+window": AttentionMask.padded(_padded_rows(rng, b, t), sliding_window=int(rng.integers(3, t // 2))),
        "packed": AttentionMask.packed(seg, pad),
        "packed runs": AttentionMask.packed(seg, pad, max_segments=8),  # 4 documents + a padding run
        "packed+window": AttentionMask.packed(seg, pad, sliding_window=5),
        "full": AttentionMask.full_causal(b, t),
    }


def _run(impl, q, k, v, dout, mask, **kw):
    """(output, dq, dk, dv) with padding queries zeroed (their output is unspecified by contract)."""
    real = (np.asarray(mask.q_segments) != 0)[:, :, None, None]

    def f(q, k, v):
        return attention(q, k, v, mask, impl=impl, **kw) * real

    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp((dout * real).astype(out.dtype)))


def _compare(impl, rng, dtype, b, t, n, kh, d, masks=None, **kw):
    q, k, v, dout = _inputs(rng, b, t, n, kh, d, dtype)
    for name, mask in (masks or _masks(rng, b, t)).items():
        ref = _run("reference", q, k, v, dout, mask)
        got = _run(impl, q, k, v, dout, mask, **kw)
        for what, o, r in zip(("out", "dq", "dk", "dv"), got, ref):
            assert o.shape == r.shape and o.dtype == r.dtype, (what, o.shape, r.shape, o.dtype, r.dtype)
            assert_close(o, r, dtype, f"{impl} {name} {what} (B={b} T={t} N={n} K={kh} D={d})")


def test_reference_matches_numpy(request):
    rng = rng_for(request)
    b, t, n, kh, d = 3, 19, 4, 2, 8
    q, k, v, _ = _inputs(rng, b, t, n, kh, d, jnp.float32)
    for name, mask in _masks(rng, b, t).items():
        out = np.asarray(attention(q, k, v, mask, impl="reference"), np.float64)
        allowed = np.asarray(mask.dense())
        qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
        for r in range(b):
            for i in range(t):
                if not np.asarray(mask.q_segments)[r, i]:
                    continue
                keys = np.flatnonzero(allowed[r, i])
                assert keys.size, f"{name}: real query {i} of row {r} has no key"
                for h in range(n):
                    s = kn[r, keys, h // (n // kh)] @ qn[r, i, h] / np.sqrt(d)
                    p = np.exp(s - s.max())
                    want = (p / p.sum()) @ vn[r, keys, h // (n // kh)]
                    np.testing.assert_allclose(out[r, i, h], want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_mask_rules_by_hand():
    am = jnp.asarray([[0, 1, 1, 1]])
    dense = np.asarray(AttentionMask.padded(am, sliding_window=2).dense())[0]
    want = np.array([[0, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], bool)
    np.testing.assert_array_equal(dense, want)
    seg = np.asarray(AttentionMask.packed(jnp.asarray([[0, 0, 1, 1]])).dense())[0]
    np.testing.assert_array_equal(seg, np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], bool))


def test_segment_runs_match_a_loop(request):
    rng = rng_for(request)
    b, t, m = 5, 37, 6
    seg = np.zeros((b, t), np.int32)
    for r in range(b):  # 1..m runs of random lengths; ids may repeat in non-adjacent runs
        cuts = np.sort(rng.choice(np.arange(1, t), size=int(rng.integers(0, m)), replace=False))
        seg[r] = rng.integers(0, 3, len(cuts) + 1)[np.searchsorted(cuts, np.arange(t), side="right")]
    start, length = map(np.asarray, segment_runs(jnp.asarray(seg), m))
    for r in range(b):
        runs = [[0, 1]]
        for i in range(1, t):
            if seg[r, i] == seg[r, i - 1]:
                runs[-1][1] += 1
            else:
                runs.append([i, 1])
        want = np.full((m, 2), -1)
        want[:len(runs)] = runs
        np.testing.assert_array_equal(np.stack([start[r], length[r]], -1), want, err_msg=f"row {r}: {seg[r]}")
    assert (length > 0).sum() > b  # some row has several runs


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_xla_blocked_matches_reference(request, dtype):
    rng = rng_for(request)
    _compare("xla", rng, dtype, b=3, t=45, n=4, kh=2, d=16, block_q=16, block_k=8)
    strided = _strided_mask(rng, 2)
    _compare("xla", rng, dtype, b=2, t=strided.shape[1], n=6, kh=3, d=8, masks={"strided": strided}, block_q=8,
             block_k=16)


def test_splash_interpret_matches_reference(request):
    rng = rng_for(request)
    b, t = 2, 256
    seg, pad = _packed_rows(rng, b, t)
    masks = {"padded": AttentionMask.padded(_padded_rows(rng, b, t)),
             "packed+window": AttentionMask.packed(seg, pad, sliding_window=40)}
    _compare("splash", rng, jnp.float32, b=b, t=t, n=4, kh=2, d=16, masks=masks)


def test_auto_never_builds_dense_scores_for_long_rows():
    t = 4096
    assert t * t > DENSE_MAX_SCORES
    q = jax.ShapeDtypeStruct((1, t, 2, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, t, 1, 8), jnp.float32)
    hlo = jax.jit(lambda q, k, v: attention(q, k, v, AttentionMask.full_causal(1, t))).lower(q, kv, kv).as_text()
    assert f"{t}x{t}" not in hlo, "auto built a [T, S] score tensor for a 4096-token row"
    short = jax.jit(lambda q, k, v: attention(q, k, v, AttentionMask.full_causal(1, 64))).lower(
        *(jax.ShapeDtypeStruct((1, 64, h, 8), jnp.float32) for h in (2, 1, 1))).as_text()
    assert "64x64" in short, "auto should take the dense path for a short row"


# ~2 min beside a second test process (2-core CPU); test_auto_never_builds_dense_scores_for_long_rows checks the pick
# in the default suite
@pytest.mark.slow
def test_long_row_forward_and_backward_of_a_small_model():
    """An 8192-token forward + backward runs on CPU through the blocked path (the dense one would need
    8192² float32 scores per head and layer)."""
    from jrl.models.config import ModelConfig
    from jrl.models.transformer import create_model

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, remat="full")
    model = create_model(cfg, seed=0)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (1, 8192)), jnp.int32)
    mask = jnp.ones((1, 8192), jnp.int32).at[0, :100].set(0)

    def loss(m):
        return jnp.mean(m.hidden_states(ids, attention_mask=mask)[0, 100:].astype(jnp.float32) ** 2)

    from flax import nnx

    value, grads = nnx.value_and_grad(loss)(model)
    assert np.isfinite(float(value))
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
    assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
    assert any(float(jnp.abs(g).max()) > 0 for g in leaves)


def test_explicit_impl_that_cannot_run_names_the_reason():
    mask = AttentionMask.from_dense(jnp.ones((1, 8, 8), bool))
    q = jnp.zeros((1, 8, 2, 8), jnp.float32)
    k = jnp.zeros((1, 8, 1, 8), jnp.float32)
    with pytest.raises(RuntimeError, match="explicit mask"):
        attention(q, k, k, mask, impl="splash")


def test_row_rotation_gradient_is_the_opposite_rotation(request):
    """The per-row rotation (the model's and the cuDNN path's) has a hand-written gradient (the inverse rotation, a
    gather): it equals autodiff's (the scatter-add of the gather) on fresh random inputs and shifts."""
    from jrl.kernels.attention.mask import _rotate
    from jrl.kernels.attention.mask import roll_rows as _roll_rows

    rng = rng_for(request)
    x = jnp.asarray(rng.standard_normal((4, 16, 3, 5)), jnp.float32)
    g = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
    shift = jnp.asarray(rng.integers(0, 16, 4), jnp.int32)
    out, vjp = jax.vjp(lambda x: _roll_rows(x, shift), x)
    ref, ref_vjp = jax.vjp(lambda x: _rotate(x, shift), x)
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(vjp(g)[0], ref_vjp(g)[0])
    assert float(jnp.abs(vjp(g)[0]).sum()) > 0
    # Under jit and inside a larger graph (the model's layer), too.
    grad = jax.jit(jax.grad(lambda x: jnp.sum(_roll_rows(x, shift) * g)))(x)
    np.testing.assert_array_equal(grad, jax.grad(lambda x: jnp.sum(_rotate(x, shift) * g))(x))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["cudnn", "xla"])
def test_gpu_impls_match_reference(request, impl):
    rng = rng_for(request)
    masks = _masks(rng, 4, 512)
    if impl == "cudnn":  # cuDNN takes padded rows and packed rows with a bound on their runs, without a window
        masks = {k: m for k, m in masks.items() if m.contiguous or (m.max_segments and m.sliding_window is None)}
        assert "packed runs" in masks  # impl="cudnn" raises, naming why, where it cannot run
    _compare(impl, rng, jnp.bfloat16, b=4, t=512, n=8, kh=2, d=64, masks=masks)
