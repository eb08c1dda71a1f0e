"""Grouped matmul (gmm / tgmm / gmm_lora) and token permutation against references: ragged and empty
groups, rows past ``sum(group_sizes)``, dims that are not a multiple of any tile, bf16 and f32, and
gradients.

CPU: reference vs a numpy loop, pallas_tpu (megablox) in interpret mode, the Triton kernels under
Triton's interpreter (subprocess), the Mosaic GPU kernel lowered for CUDA. GPU (``-m gpu``): the triton and
mosaic_gpu implementations on the device.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels import moe
from jrl.kernels.moe import pallas_tpu, reference
from kernels_testlib import (assert_close, group_sizes_cases, np_gmm, np_tgmm, rng_for, run_interpreter_script,
                             run_script)

HERE = os.path.dirname(os.path.abspath(__file__))
SMALL_TPU = pallas_tpu.Configs(fwd=(16, 128, 128), dlhs=(8, 128, 128), tgmm=(16, 128, 128))


def make(rng, t, k, n, e, dtype, gs):
    lhs = jnp.asarray(rng.standard_normal((t, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((e, k, n)) / np.sqrt(k), dtype)
    dout = jnp.asarray(rng.standard_normal((t, n)), jnp.float32)
    return lhs, rhs, jnp.asarray(gs, jnp.int32), dout


def check_gmm(impl, rng, t, k, n, e, dtype, gs, **kw):
    lhs, rhs, gs, dout = make(rng, t, k, n, e, dtype, gs)

    def f(fn):
        out, vjp = jax.vjp(lambda a, b: fn(a, b, gs), lhs, rhs)
        return (out, *vjp(dout.astype(out.dtype)))

    ref = f(reference.gmm)
    got = f(lambda a, b, g: moe.gmm(a, b, g, impl=impl, **kw))
    total = int(np.sum(np.asarray(gs)))
    for name, o, r in zip(["out", "d lhs", "d rhs"], got, ref):
        assert o.shape == r.shape and o.dtype == r.dtype, (name, o.shape, r.shape, o.dtype, r.dtype)
        assert_close(o, r, dtype, f"{impl} gmm {name} t={t} k={k} n={n} gs={np.asarray(gs).tolist()}")
    assert np.all(np.asarray(got[0][total:], np.float32) == 0), "rows past sum(group_sizes) must be zero"
    assert np.all(np.asarray(got[1][total:], np.float32) == 0)


# --- reference --------------------------------------------------------------------------------


def test_reference_matches_numpy(request):
    rng = rng_for(request)
    for name, gs in group_sizes_cases(50, 6, rng).items():
        lhs, rhs, gsj, dout = make(rng, 50, 24, 40, 6, jnp.float32, gs)
        assert_close(reference.gmm(lhs, rhs, gsj), np_gmm(lhs, rhs, gs), jnp.float32, f"gmm {name}")
        assert_close(reference.tgmm(lhs, dout, gsj), np_tgmm(lhs, dout, gs), jnp.float32, f"tgmm {name}")
        a = jnp.asarray(rng.standard_normal((6, 24, 3)), jnp.float32)
        b = jnp.asarray(rng.standard_normal((6, 3, 40)), jnp.float32)
        dense = np.asarray(rhs, np.float64) + 0.5 * np.einsum("ekr,ern->ekn", np.asarray(a, np.float64),
                                                              np.asarray(b, np.float64))
        assert_close(reference.gmm_lora(lhs, rhs, a, b, 0.5, gsj), np_gmm(lhs, dense, gs), jnp.float32, "lora")


# --- Pallas TPU (megablox) in interpret mode --------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_pallas_tpu_interpret_matches_reference(request, dtype):
    rng = rng_for(request)
    for name, gs in group_sizes_cases(45, 5, rng).items():
        check_gmm("pallas_tpu", rng, 45, 24, 40, 5, dtype, gs, configs=SMALL_TPU, interpret=True)


def test_pallas_tpu_interpret_tgmm(request):
    rng = rng_for(request)
    gs = group_sizes_cases(40, 4, rng)["sum<T"]
    lhs, _, gsj, dout = make(rng, 40, 24, 40, 4, jnp.float32, gs)
    out = moe.tgmm(lhs, dout, gsj, impl="pallas_tpu", configs=SMALL_TPU, interpret=True)
    assert_close(out, np_tgmm(lhs, dout, gs), jnp.float32, "tgmm")


# --- LoRA on experts --------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["reference", "pallas_tpu"])
def test_gmm_lora_matches_materialized_delta(request, impl):
    rng = rng_for(request)
    t, k, n, e, r, s = 37, 16, 24, 4, 4, 0.75
    gs = group_sizes_cases(t, e, rng)["ragged"]
    lhs, rhs, gsj, dout = make(rng, t, k, n, e, jnp.float32, gs)
    a = jnp.asarray(rng.standard_normal((e, k, r)) / 4, jnp.float32)
    b = jnp.asarray(rng.standard_normal((e, r, n)) / 2, jnp.float32)
    def lora(x, w, a_, b_):
        return moe.gmm_lora(x, w, a_, b_, s, gsj, impl=impl)

    def dense(x, w, a_, b_):  # W + s * A @ B materialized per expert
        return reference.gmm(x, w + s * jnp.einsum("ekr,ern->ekn", a_, b_, precision="highest"), gsj)

    out, vjp = jax.vjp(lora, lhs, rhs, a, b)
    ref, vjp_ref = jax.vjp(dense, lhs, rhs, a, b)
    assert_close(out, ref, jnp.float32, "gmm_lora out")
    for name, g, gr in zip(["d x", "d W", "d A", "d B"], vjp(dout), vjp_ref(dout)):
        assert_close(g, gr, jnp.float32, f"gmm_lora {name}")


# --- permute / unpermute -----------------------------------------------------------------------


def dense_moe(x, w, weights, idx):
    """Every token through its k experts with a per-token matmul (no sorting), float32."""
    per = jnp.einsum("th,thn->tn", jnp.repeat(x, idx.shape[1], axis=0), w[idx.reshape(-1)],
                     precision="highest").reshape(*idx.shape, -1)
    return jnp.einsum("tkn,tk->tn", per, weights)


@pytest.mark.parametrize("impl", ["reference", "pallas_tpu"])
def test_permute_gmm_unpermute_matches_dense(request, impl):
    rng = rng_for(request)
    t, h, n, e, k = 19, 16, 24, 6, 2
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((e, h, n)) / 4, jnp.float32)
    weights = jnp.asarray(rng.random((t, k)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.choice(e - 1, k, replace=False) for _ in range(t)]), jnp.int32)  # expert e-1 empty

    def routed(x_, w_, wt):
        perm = moe.permute(x_, idx, e)
        return moe.unpermute(moe.gmm(perm.sorted_x, w_, perm.group_sizes, impl=impl), perm, wt)

    out, vjp = jax.vjp(routed, x, w, weights)
    ref, vjp_ref = jax.vjp(lambda a, b, c: dense_moe(a, b, c, idx), x, w, weights)
    assert_close(out, ref, jnp.float32, "moe out")
    dy = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
    for name, g, gr in zip(["d x", "d W", "d weights"], vjp(dy), vjp_ref(dy)):
        assert_close(g, gr, jnp.float32, f"moe {name}")
    perm = moe.permute(x, idx, e)
    assert int(perm.group_sizes[e - 1]) == 0 and int(perm.group_sizes.sum()) == t * k


def test_unpermute_inverts_permute(request):
    rng = rng_for(request)
    t, h, e, k = 11, 8, 5, 3
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, e, (t, k)), jnp.int32)
    perm = moe.permute(x, idx, e)
    # Experts are non-decreasing along the sorted rows.
    assert np.all(np.diff(np.asarray(idx).reshape(-1)[np.asarray(perm.order)]) >= 0)
    y = moe.unpermute(perm.sorted_x, perm, jnp.ones((t, k), jnp.float32) / k)
    assert_close(y, x, jnp.float32, "unpermute(permute(x))")


# --- Triton kernels under Triton's interpreter --------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
                    reason="needs triton and torch (Triton's CPU interpreter runs on torch tensors)")
def test_triton_kernels_in_interpreter():
    run_interpreter_script(os.path.join(HERE, "triton_interpret_moe.py"))


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (compiles for sm_90, no GPU needed)")
def test_triton_kernels_compile_for_hopper():
    """Every Triton kernel (MoE and logprobs) compiles for sm_90 with wgmma and pipelined cp.async loads."""
    res = run_script(os.path.join(HERE, "triton_compile_check.py"))
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr[-3000:]}"


def test_tile_schedule_covers_every_row_once(request):
    from jrl.kernels.moe.schedule import tile_schedule

    rng = rng_for(request)
    for t, e, bm in [(100, 7, 16), (64, 4, 64), (5, 3, 128), (1000, 64, 128)]:
        for gs in group_sizes_cases(t, e, rng).values():
            tg, rs, re_ = (np.asarray(a) for a in tile_schedule(jnp.asarray(gs), t, bm))
            owner = np.full(t, -1)
            for g, s0, s1 in zip(tg, rs, re_):
                if g < 0:
                    continue
                rows = np.arange(s0, min(s0 + bm, s1))
                assert np.all(owner[rows] == -1), "row covered twice"
                owner[rows] = g
            expect = np.concatenate([np.repeat(np.arange(e), gs), np.full(t - gs.sum(), e)])
            np.testing.assert_array_equal(owner, expect)


def test_aligned_tile_schedule_covers_every_row_once(request):
    """Every row stored by exactly one tile of its group (rows past the sum by the sentinel group), each tile's stored
    rows inside the rows it loads, every load start a multiple of ``align`` inside the array; with ``align`` equal to
    the tile height the tiles are the row blocks."""
    from jrl.kernels.moe.schedule import aligned_tile_schedule

    rng = rng_for(request)
    for t, e, bm, align in [(96, 7, 16, 8), (64, 4, 64, None), (128, 3, 128, 8), (1024, 64, 128, None),
                            (1024, 64, 128, 8), (256, 2, 128, 32)]:
        for gs in [*group_sizes_cases(t, e, rng).values(), np.full(e, t // e, np.int32)]:
            g, start, lo, hi, live = (np.asarray(a) for a in aligned_tile_schedule(jnp.asarray(gs), t, bm, align))
            a = align or bm
            lead = 0 if a == bm else (e + 1) * (a - 1)
            assert live.shape == (1,) and live[0] <= g.shape[0] == -(-(t + lead) // bm) + e + 1
            owner = np.full(t, -1)
            for i in range(live[0]):
                assert start[i] <= lo[i] < hi[i] <= start[i] + bm, "stored rows outside the loaded ones"
                assert start[i] % a == 0 and 0 <= start[i] <= t - bm, "load start unaligned or out of range"
                assert np.all(owner[lo[i]:hi[i]] == -1), "row covered twice"
                owner[lo[i]:hi[i]] = g[i]
            expect = np.concatenate([np.repeat(np.arange(e), gs), np.full(t - gs.sum(), e)])
            np.testing.assert_array_equal(owner, expect)
            if a == bm:  # row blocks: as many tiles as (group, block) intersections
                blocks = {(k, r // bm) for k, r in zip(expect, range(t))}
                assert live[0] == len(blocks)


def test_tile_schedule_lowers_without_a_loop():
    """The schedule runs before every grouped-matmul launch: lowered for CUDA it has no ``while`` (a binary search
    there cost ~0.05 ms per launch on an H200, a launch per iteration with the condition read back by the host)."""
    from jrl.kernels.moe.schedule import aligned_tile_schedule

    for align in (None, 8):
        text = jax.jit(lambda g, a=align: aligned_tile_schedule(g, 65536, 128, a)).trace(
            jax.ShapeDtypeStruct((128,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
        assert "stablehlo.while" not in text and "stablehlo.case" not in text


# --- Mosaic GPU kernel (lowered for CUDA here; run under -m gpu) ---------------------------------


def test_mosaic_gpu_kernel_lowers_for_cuda():
    """The Hopper kernel traces and lowers to a Mosaic GPU custom call without a GPU: forward, transposed rhs
    (the input gradient), the M split with a float32 output, row-block tiles, the rows past the groups unwritten."""
    from jrl.kernels.moe import mosaic_gpu_kernel as mk

    t, k, n, e = 512, 256, 512, 8
    for cfg, transpose, out_dtype, fill in [(mk.DEFAULT_CONFIG, False, jnp.bfloat16, True),
                                            (mk.DEFAULT_CONFIG, True, jnp.bfloat16, True),
                                            (mk.MosaicGmmConfig(split="m", stages=3), True, jnp.float32, True),
                                            (mk.MosaicGmmConfig(row_align=None), False, jnp.bfloat16, True),
                                            (mk.DEFAULT_CONFIG, True, jnp.bfloat16, False)]:
        rhs = jax.ShapeDtypeStruct((e, n, k) if transpose else (e, k, n), jnp.bfloat16)
        assert mk.unsupported_reason((t, k), jnp.bfloat16, rhs.shape, rhs.dtype, transpose_rhs=transpose, cfg=cfg) \
            is None
        f = jax.jit(lambda a, b, g, cfg=cfg, transpose=transpose, od=out_dtype, fill=fill: mk.gmm_call(
            a, b, g, transpose_rhs=transpose, out_dtype=od, cfg=cfg, num_sms=132, fill_past_groups=fill))
        text = f.trace(jax.ShapeDtypeStruct((t, k), jnp.bfloat16), rhs,
                       jax.ShapeDtypeStruct((e,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text and f"tensor<{t}x{n}x{'f32' if out_dtype == jnp.float32 else 'bf16'}>" in text


def test_mosaic_gpu_kernel_names_what_does_not_fit():
    from jrl.kernels.moe.mosaic_gpu_kernel import MosaicGmmConfig, unsupported_reason

    assert "bf16/f16" in unsupported_reason((512, 256), jnp.float32, (8, 256, 512), jnp.float32)
    assert "T=500" in unsupported_reason((500, 256), jnp.bfloat16, (8, 256, 512), jnp.bfloat16)
    assert "N=96" in unsupported_reason((512, 256), jnp.bfloat16, (8, 256, 96), jnp.bfloat16)
    assert "N=96" in unsupported_reason((512, 256), jnp.bfloat16, (8, 96, 256), jnp.bfloat16, transpose_rhs=True)
    assert "empty" in unsupported_reason((0, 256), jnp.bfloat16, (8, 256, 512), jnp.bfloat16)
    assert "row_align=12" in unsupported_reason((512, 256), jnp.bfloat16, (8, 256, 512), jnp.bfloat16,
                                                cfg=MosaicGmmConfig(row_align=12))


# --- dispatch -------------------------------------------------------------------------------


def test_unknown_impl_lists_available():
    with pytest.raises(ValueError, match="available: 'auto', 'reference', 'pallas_tpu', 'triton'"):
        moe.gmm(jnp.zeros((4, 2)), jnp.zeros((1, 2, 3)), jnp.array([4], jnp.int32), impl="megablocks")


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="K="):
        moe.gmm(jnp.zeros((4, 2)), jnp.zeros((1, 3, 3)), jnp.array([4], jnp.int32))
    with pytest.raises(ValueError, match="group_sizes"):
        moe.gmm(jnp.zeros((4, 2)), jnp.zeros((2, 2, 3)), jnp.array([4], jnp.int32))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU choice")
def test_auto_on_cpu_is_reference_and_logged_once(request, caplog):
    rng = rng_for(request)
    lhs, rhs, gs, _ = make(rng, 9, 5, 7, 2, jnp.float32, [4, 5])
    with caplog.at_level(logging.DEBUG, logger="jrl.kernels"):
        out = moe.gmm(lhs, rhs, gs)
        moe.gmm(lhs, rhs, gs)
    lines = [r.getMessage() for r in caplog.records if "gmm" in r.getMessage() and "(9, 5)" in r.getMessage()]
    assert len(lines) == 1 and "'reference'" in lines[0], lines
    assert_close(out, np_gmm(lhs, rhs, [4, 5]), jnp.float32)


# --- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("t,k,n,e", [(1000, 256, 320, 8), (777, 200, 96, 64), (64, 48, 40, 3)])
def test_gpu_triton_matches_reference(request, dtype, t, k, n, e):
    rng = rng_for(request)
    for gs in group_sizes_cases(t, e, rng).values():
        check_gmm("triton", rng, t, k, n, e, dtype, gs)


@pytest.mark.gpu
def test_gpu_triton_tgmm_and_lora(request):
    rng = rng_for(request)
    t, k, n, e, r = 900, 128, 192, 16, 8
    gs = group_sizes_cases(t, e, rng)["sum<T"]
    lhs, rhs, gsj, dout = make(rng, t, k, n, e, jnp.bfloat16, gs)
    assert_close(moe.tgmm(lhs, dout.astype(jnp.bfloat16), gsj, impl="triton"),
                 reference.tgmm(lhs, dout.astype(jnp.bfloat16), gsj), jnp.bfloat16, "tgmm")
    a = jnp.asarray(rng.standard_normal((e, k, r)) / 8, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((e, r, n)) / 2, jnp.bfloat16)

    def loss(impl):
        return jax.vjp(lambda x, w, a_, b_: moe.gmm_lora(x, w, a_, b_, 2.0, gsj, impl=impl), lhs, rhs, a, b)

    out, vjp = loss("triton")
    ref, vjp_ref = loss("reference")
    assert_close(out, ref, jnp.bfloat16, "lora out")
    for name, g, gr in zip(["x", "W", "A", "B"], vjp(out), vjp_ref(out)):
        assert_close(g, gr, jnp.bfloat16, f"lora d{name}")


@pytest.mark.gpu
def test_gpu_auto_picks_mosaic_where_its_tiles_fit():
    from jrl.kernels.moe import mosaic_gpu

    hopper = mosaic_gpu.unavailable_reason() is None
    fits = (jnp.zeros((512, 256), jnp.bfloat16), jnp.zeros((4, 256, 512), jnp.bfloat16), jnp.zeros((4,), jnp.int32))
    odd = (jnp.zeros((500, 256), jnp.bfloat16), jnp.zeros((4, 256, 96), jnp.bfloat16), jnp.zeros((4,), jnp.int32))
    assert moe.api._select("auto", *fits)[0] == ("mosaic_gpu" if hopper else "triton")
    assert moe.api._select("auto", *odd)[0] == "triton"


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,n,e", [(1024, 512, 512, 8), (2048, 256, 768, 64), (640, 512, 256, 3)])
def test_gpu_mosaic_matches_reference(request, t, k, n, e):
    """Forward on the Mosaic kernel, the input gradient on it too where K fits its tiles (K % 256), the weight
    gradient on Triton; ragged groups with an empty one, a sum below T (rows past it must be zero, written without a
    product) and a quarter of the rows routed (an expert-parallel device's buffer: most tiles are such rows)."""
    from jrl.kernels.moe import mosaic_gpu

    if mosaic_gpu.unavailable_reason():
        pytest.skip(mosaic_gpu.unavailable_reason())
    rng = rng_for(request)
    quarter = rng.multinomial(t // 4, np.full(e, 1.0 / e)).astype(np.int32)
    for gs in [*group_sizes_cases(t, e, rng).values(), np.full(e, t // e, np.int32), quarter]:
        check_gmm("mosaic_gpu", rng, t, k, n, e, jnp.bfloat16, gs)


@pytest.mark.gpu
def test_gpu_mosaic_kernel_configs_float32_output(request):
    from jrl.kernels.moe import mosaic_gpu, mosaic_gpu_kernel as mk

    if mosaic_gpu.unavailable_reason():
        pytest.skip(mosaic_gpu.unavailable_reason())
    rng = rng_for(request)
    t, k, n, e = 1024, 256, 512, 8
    for cfg in (mk.DEFAULT_CONFIG, mk.MosaicGmmConfig(split="m", stages=3), mk.MosaicGmmConfig(row_align=None),
                mk.MosaicGmmConfig(split="m", stages=3, row_align=None)):
        for gs in group_sizes_cases(t, e, rng).values():
            lhs, rhs, gsj, _ = make(rng, t, k, n, e, jnp.bfloat16, gs)
            out = mk.gmm_call(lhs, rhs, gsj, transpose_rhs=False, out_dtype=jnp.float32, cfg=cfg)
            assert out.dtype == jnp.float32
            # bf16 operands, float32 accumulation and output: the float64 product of the bf16 values
            assert_close(out, np_gmm(lhs, rhs, gs), jnp.float32, f"{cfg} f32 out")
            rhs_t = jnp.swapaxes(rhs, 1, 2)  # [E, N, K]: the input gradient's operand, read transposed
            out_t = mk.gmm_call(lhs, rhs_t, gsj, transpose_rhs=True, out_dtype=jnp.float32, cfg=cfg)
            assert_close(out_t, np_gmm(lhs, rhs, gs), jnp.float32, f"{cfg} transposed f32 out")


@pytest.mark.gpu
def test_gpu_mosaic_refuses_float32_by_name():
    from jrl.kernels._dispatch import ImplUnavailable

    with pytest.raises(ImplUnavailable, match="bf16/f16"):
        moe.gmm(jnp.zeros((512, 256)), jnp.zeros((4, 256, 512)), jnp.array([512, 0, 0, 0], jnp.int32),
                impl="mosaic_gpu")


@pytest.mark.gpu
@pytest.mark.parametrize("impl,t,k,n", [("triton", 300, 64, 96), ("mosaic_gpu", 512, 256, 256)])
def test_gpu_under_vmap_and_grad(request, impl, t, k, n):
    from jrl.kernels.moe import mosaic_gpu

    if impl == "mosaic_gpu" and mosaic_gpu.unavailable_reason():
        pytest.skip(mosaic_gpu.unavailable_reason())
    rng = rng_for(request)
    b, e = 2, 4
    lhs = jnp.asarray(rng.standard_normal((b, t, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((e, k, n)) / 8, jnp.bfloat16)
    gs = jnp.asarray(np.stack([group_sizes_cases(t, e, rng)["ragged"] for _ in range(b)]), jnp.int32)

    def f(x, w):  # vmap over the batch (the kernel wrappers loop over it)
        y = jax.vmap(lambda a, g: moe.gmm(a, w, g, impl=impl))(x, gs)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    def f_ref(x, w):  # ragged_dot cannot vmap over batched group sizes: a Python loop
        return sum(jnp.sum(reference.gmm(x[i], w, gs[i]).astype(jnp.float32) ** 2) for i in range(b))

    v, (dx, dw) = jax.value_and_grad(f, argnums=(0, 1))(lhs, rhs)
    v_r, (dx_r, dw_r) = jax.value_and_grad(f_ref, argnums=(0, 1))(lhs, rhs)
    assert_close(v, v_r, jnp.bfloat16, "vmap value")
    assert_close(dx, dx_r, jnp.bfloat16, "vmap d lhs")
    assert_close(dw, dw_r, jnp.bfloat16, "vmap d rhs")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "mosaic_gpu"])
def test_gpu_rows_past_the_groups_may_stay_unwritten(request, impl):
    """``fill_past_groups=False``: the rows in use (output and input gradient) equal the reference's."""
    rng = rng_for(request)
    t, k, n, e = 2048, 256, 512, 8
    gs = [100, 0, 300, 57, 3, 20, 0, 31]  # a quarter of the rows in use
    used = sum(gs)
    lhs, rhs, gsj, dout = make(rng, t, k, n, e, jnp.bfloat16, gs)

    def run(impl_, fill):
        out, vjp = jax.vjp(lambda a, b: moe.gmm(a, b, gsj, impl=impl_, fill_past_groups=fill), lhs, rhs)
        return (out, *vjp(dout.astype(out.dtype)))

    (out, dlhs, drhs), (ref, dlhs_ref, drhs_ref) = run(impl, False), run("reference", True)
    assert_close(out[:used], ref[:used], jnp.bfloat16, f"{impl} out")
    assert_close(dlhs[:used], dlhs_ref[:used], jnp.bfloat16, f"{impl} d lhs")
    assert_close(drhs, drhs_ref, jnp.bfloat16, f"{impl} d rhs")
