"""The MoE layer's row operations (``jrl.kernels.moe.rows``): ``take_rows`` and ``swiglu`` skip the rows a buffer
does not use. CPU: the reference against numpy; the Triton kernels run under Triton's interpreter in
``triton_interpret_moe.py`` (test_moe.py). GPU (``-m gpu``): the triton implementation against the reference, and
the expert-parallel pairs routed nowhere through permute / gmm / unpermute against the dense layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels import moe
from jrl.kernels.moe.rows import swiglu, take_rows
from kernels_testlib import assert_close, rng_for


def _take_case(rng, nsrc, h, k, r, dtype):
    src = jnp.asarray(rng.standard_normal((nsrc, h)), dtype)
    index = jnp.asarray(rng.permutation(nsrc * k + 5)[:r], jnp.int32)  # some entries past nsrc * k
    scale = jnp.asarray(rng.random(nsrc * k), jnp.float32)
    return src, index, scale


def _np_take(src, index, k, scale=None):
    src, index = np.asarray(src, np.float64), np.asarray(index)
    live = index // k < src.shape[0]
    out = np.where(live[:, None], src[np.minimum(index // k, src.shape[0] - 1)], 0)
    if scale is not None:
        out = out * np.where(live, np.asarray(scale)[np.minimum(index, len(scale) - 1)], 0)[:, None]
    return out


def _np_swiglu(a, b, g, count):
    a, b, g = (np.asarray(v, np.float64) for v in (a, b, g))
    live = (np.arange(a.shape[0]) < count)[:, None]
    sig = 1 / (1 + np.exp(-a))
    return (np.where(live, a * sig * b, 0), np.where(live, g * b * sig * (1 + a * (1 - sig)), 0),
            np.where(live, g * a * sig, 0))


def _swiglu_with_grads(a, b, g, count, impl):
    out, vjp = jax.vjp(lambda a_, b_: swiglu(a_, b_, count, impl=impl), a, b)
    return (out, *vjp(g))


def test_reference_take_rows_matches_numpy(request):
    rng = rng_for(request)
    src, index, scale = _take_case(rng, 9, 12, 3, 25, jnp.float32)
    assert_close(take_rows(src, index, k=3, impl="reference"), _np_take(src, index, 3), jnp.float32, "take_rows")
    out = take_rows(src, index, k=3, scale=scale, dtype=jnp.bfloat16, impl="reference")
    assert out.dtype == jnp.bfloat16
    assert_close(out, _np_take(src, index, 3, scale), jnp.bfloat16, "take_rows scaled")


@pytest.mark.parametrize("count", [0, 7, 17])
def test_reference_swiglu_and_its_gradients_match_numpy(request, count):
    rng = rng_for(request)
    a, b, g = (jnp.asarray(rng.standard_normal((17, 10)), jnp.float32) for _ in range(3))
    for got, want, name in zip(_swiglu_with_grads(a, b, g, count, "reference"), _np_swiglu(a, b, g, count),
                               ["out", "d a", "d b"]):
        assert_close(got, want, jnp.float32, f"swiglu {name}")


def test_pairs_routed_nowhere_add_zero_and_get_no_gradient(request):
    """ids >= num_experts (an expert-parallel device's view of its peers' experts): permute -> gmm -> unpermute
    equals the dense layer over the routed pairs alone, with its gradients; the sorted rows past the groups are
    zeros."""
    rng = rng_for(request)
    t, h, n, e, k = 23, 16, 12, 4, 3
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((e, h, n)) / 4, jnp.float32)
    weights = jnp.asarray(rng.random((t, k)), jnp.float32)
    ids = np.stack([rng.choice(2 * e, k, replace=False) for _ in range(t)]).astype(np.int32)  # half elsewhere
    routed = ids < e

    def layer(x_, w_, wt):
        perm = moe.permute(x_, jnp.asarray(ids), e)
        return moe.unpermute(moe.gmm(perm.sorted_x, w_, perm.group_sizes, impl="reference"), perm, wt)

    def dense(x_, w_, wt):
        per = jnp.einsum("th,thn->tn", jnp.repeat(x_, k, axis=0), w_[np.minimum(ids, e - 1).reshape(-1)],
                         precision="highest").reshape(t, k, n)
        return jnp.einsum("tkn,tk->tn", per, jnp.where(routed, wt, 0))

    out, vjp = jax.vjp(layer, x, w, weights)
    ref, vjp_ref = jax.vjp(dense, x, w, weights)
    assert_close(out, ref, jnp.float32, "out")
    dy = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
    for name, got, want in zip(["d x", "d W", "d weights"], vjp(dy), vjp_ref(dy)):
        assert_close(got, want, jnp.float32, name)
    perm = moe.permute(x, jnp.asarray(ids), e)
    used = int(routed.sum())
    assert int(perm.group_sizes.sum()) == used
    assert float(jnp.abs(perm.sorted_x[used:]).max()) == 0.0


# --- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("nsrc,h,k,r", [(300, 2048, 8, 2500), (37, 200, 1, 40), (64, 768, 4, 512)])
def test_gpu_triton_take_rows_matches_reference(request, dtype, nsrc, h, k, r):
    rng = rng_for(request)
    src, index, scale = _take_case(rng, nsrc, h, k, r, dtype)
    want = take_rows(src, index, k=k, impl="reference")
    assert_close(take_rows(src, index, k=k, impl="triton"), want, dtype, "take_rows", tol=0.0)
    routed = np.asarray(index) // k < nsrc  # fill=False: the rows routed nowhere are not compared (unspecified)
    assert_close(np.asarray(take_rows(src, index, k=k, fill=False, impl="triton"), np.float32)[routed],
                 np.asarray(want, np.float32)[routed], dtype, "take_rows fill=False", tol=0.0)
    assert_close(take_rows(src.astype(jnp.float32), index, k=k, scale=scale, dtype=dtype, impl="triton"),
                 take_rows(src.astype(jnp.float32), index, k=k, scale=scale, dtype=dtype, impl="reference"), dtype,
                 "take_rows scaled")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("r,f,count", [(4096, 768, 1000), (333, 200, 333), (512, 96, 0)])
def test_gpu_triton_swiglu_matches_reference(request, dtype, r, f, count):
    rng = rng_for(request)
    a, b, g = (jnp.asarray(rng.standard_normal((r, f)), dtype) for _ in range(3))
    want = _swiglu_with_grads(a, b, g, count, "reference")
    for got, ref, name in zip(_swiglu_with_grads(a, b, g, count, "triton"), want, ["out", "d a", "d b"]):
        assert got.dtype == dtype
        assert_close(got[:count], ref[:count], dtype, f"swiglu {name}")  # the rows past count are unspecified
