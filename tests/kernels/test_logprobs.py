"""Fused logprob/entropy kernels against the pure-JAX reference: values and gradients, on fresh random
inputs, odd vocab sizes, row counts that are not a multiple of any block, masked tokens, bf16 and f32.

CPU: xla, pallas_tpu (interpret mode) and the Triton kernels under Triton's interpreter (subprocess).
GPU (``-m gpu``): triton (logits recomputed in the backward by Triton or XLA, and the save_probs backward)
and xla on the device.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels import logprobs
from jrl.kernels.logprobs import pallas_tpu, reference
from kernels_testlib import assert_close, rel_err, rng_for, run_interpreter_script

HERE = os.path.dirname(os.path.abspath(__file__))
SMALL_TPU = pallas_tpu.Config(fwd=(8, 128), dh=(8, 128), dw=(16, 128))


def make_inputs(rng, n, h, v, dtype, scale=0.5):
    hidden = jnp.asarray(rng.standard_normal((n, h)), dtype)
    lm_head = jnp.asarray(rng.standard_normal((h, v)) * scale / np.sqrt(h) * 4, dtype)
    targets = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    mask = jnp.asarray(rng.random(n) < 0.8, jnp.float32)  # masked tokens get zero cotangent
    g_lp = jnp.asarray(rng.standard_normal(n), jnp.float32) * mask
    g_ent = jnp.asarray(rng.standard_normal(n), jnp.float32) * mask
    return hidden, lm_head, targets, g_lp, g_ent


def value_and_grads(fn, hidden, lm_head, targets, g_lp, g_ent, with_entropy, **kw):
    def loss(h, w):
        lp, ent = fn(h, w, targets, with_entropy=with_entropy, **kw)
        out = jnp.sum(lp * g_lp)
        if with_entropy:
            out = out + jnp.sum(ent * g_ent)
        return out, (lp, ent)

    (_, (lp, ent)), (dh, dw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(hidden, lm_head)
    return lp, ent, dh, dw


def check_against_reference(impl, rng, n, h, v, dtype, *, with_entropy=True, temperature=0.7, lm_head_f32=False,
                            scale=0.5, **kw):
    hidden, lm_head, targets, g_lp, g_ent = make_inputs(rng, n, h, v, dtype, scale=scale)
    common = dict(temperature=temperature, lm_head_f32=lm_head_f32)
    ref = value_and_grads(reference.token_logprobs, hidden, lm_head, targets, g_lp, g_ent, with_entropy, **common)
    out = value_and_grads(lambda *a, **k: logprobs.token_logprobs(*a, impl=impl, **k, **kw),
                          hidden, lm_head, targets, g_lp, g_ent, with_entropy, **common)
    names = ["logprobs", "entropy", "d hidden", "d lm_head"]
    for name, o, r in zip(names, out, ref):
        if name == "entropy" and not with_entropy:
            assert o is None and r is None
            continue
        assert o.shape == r.shape and o.dtype == r.dtype, (name, o.shape, r.shape, o.dtype, r.dtype)
        assert_close(o, r, dtype, f"{impl} {name} n={n} h={h} v={v} {jnp.dtype(dtype).name}")
    assert out[0].dtype == jnp.float32


# --- error measure ----------------------------------------------------------------------------


def test_nan_never_passes():
    a = jnp.ones((4,))
    assert rel_err(a.at[1].set(jnp.nan), a) == float("inf")
    assert rel_err(a, a.at[2].set(jnp.inf)) == float("inf")
    with pytest.raises(AssertionError):
        assert_close(a.at[0].set(jnp.nan), a, jnp.float32)


# --- xla (vocab-tiled scan) -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n,h,v,block_v", [(37, 48, 300, 128), (16, 32, 256, 128), (5, 24, 97, 128),
                                           (29, 40, 1000, 256)])
def test_xla_matches_reference(request, dtype, n, h, v, block_v):
    check_against_reference("xla", rng_for(request), n, h, v, dtype, block_v=block_v)


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_xla_options(request, with_entropy, temperature):
    check_against_reference("xla", rng_for(request), 21, 32, 333, jnp.float32, with_entropy=with_entropy,
                            temperature=temperature, block_v=128)


def test_xla_lm_head_f32(request):
    """bf16 inputs with the f32-matmul flag: matches the reference's full-f32 logits at f32 accuracy."""
    rng = rng_for(request)
    hidden, lm_head, targets, *_ = make_inputs(rng, 33, 64, 515, jnp.bfloat16)
    ref_lp, ref_ent = reference.token_logprobs(hidden, lm_head, targets, with_entropy=True, lm_head_f32=True)
    lp, ent = logprobs.token_logprobs(hidden, lm_head, targets, with_entropy=True, lm_head_f32=True, impl="xla",
                                      block_v=128)
    assert_close(lp, ref_lp, jnp.float32, "logprobs")
    assert_close(ent, ref_ent, jnp.float32, "entropy")
    check_against_reference("xla", rng, 33, 64, 515, jnp.bfloat16, lm_head_f32=True, block_v=128)


def test_xla_default_block_and_jit(request):
    rng = rng_for(request)
    hidden, lm_head, targets, *_ = make_inputs(rng, 40, 16, 4099, jnp.float32)
    f = jax.jit(lambda h, w, t: logprobs.token_logprobs(h, w, t, with_entropy=True, impl="xla"))
    lp, ent = f(hidden, lm_head, targets)
    ref_lp, ref_ent = reference.token_logprobs(hidden, lm_head, targets, with_entropy=True)
    assert_close(lp, ref_lp, jnp.float32, "logprobs")
    assert_close(ent, ref_ent, jnp.float32, "entropy")


def test_xla_traced_temperature(request):
    rng = rng_for(request)
    hidden, lm_head, targets, *_ = make_inputs(rng, 12, 16, 200, jnp.float32)
    f = jax.jit(lambda h, w, t, temp: logprobs.token_logprobs(h, w, t, temperature=temp))
    lp, _ = f(hidden, lm_head, targets, jnp.float32(0.6))
    assert_close(lp, reference.token_logprobs(hidden, lm_head, targets, temperature=0.6)[0], jnp.float32)


def test_logprobs_are_normalized(request):
    """exp(logprob) summed over every possible target is 1 (a check independent of the reference)."""
    rng = rng_for(request)
    v = 77
    hidden, lm_head, _, *_ = make_inputs(rng, 3, 8, v, jnp.float32)
    h = jnp.repeat(hidden, v, axis=0)
    t = jnp.tile(jnp.arange(v, dtype=jnp.int32), 3)
    lp, _ = logprobs.token_logprobs(h, lm_head, t, impl="xla", block_v=128)
    np.testing.assert_allclose(np.exp(np.asarray(lp)).reshape(3, v).sum(1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("store", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_dz_from_saved_probs_matches_recompute(request, store):
    """The save_probs backward's math (``_common.dz_from_saved``, shared by the GPU path): dz from the
    forward's saved ``exp(l - running max)`` tiles equals dz from recomputed logits, for a full chunk with a
    traced start and a remainder chunk, with running maxima that restart per vocab split (as the kernel's
    do), and stays finite where ``e`` underflows to 0."""
    from jrl.kernels.logprobs._common import dz_from_saved, dz_tile

    rng = rng_for(request)
    n, v, bv, splits = 9, 203, 16, 3
    l = rng.standard_normal((n, v)) * 3.0
    l[:, 4 * bv + 7] = -2000.0  # in the first checked chunk: e underflows to exactly 0 there (p = 0, log e = -inf)
    tiles = -(-v // bv)
    per_split = -(-tiles // splits)
    e = np.zeros((n, v))
    mt = np.zeros((n, tiles))
    for i in range(tiles):
        first = (i // per_split) * per_split  # the running max restarts at each split
        m = l[:, first * bv:(i + 1) * bv].max(1)
        mt[:, i] = m
        e[:, i * bv:(i + 1) * bv] = np.exp(l[:, i * bv:(i + 1) * bv] - m[:, None])
    lse = np.log(np.exp(l).sum(1))
    ent = lse - (np.exp(l - lse[:, None]) * l).sum(1)
    targets = jnp.asarray(rng.integers(0, v, n), jnp.int32)
    g_lp, g_ent = (jnp.asarray(rng.standard_normal(n), jnp.float32) for _ in range(2))
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    common = (targets, f32(lse), f32(ent), g_lp, g_ent, jnp.float32(0.8), True)
    chunk = 4 * bv
    full = jax.jit(lambda v0: dz_from_saved(jnp.asarray(e, store), f32(mt), bv, v0, chunk, *common))
    for v0, width in [(chunk, chunk), ((v // chunk) * chunk, v % chunk)]:
        got = full(jnp.int32(v0)) if width == chunk else \
            dz_from_saved(jnp.asarray(e, store), f32(mt), bv, v0, width, *common)
        cols = v0 + jnp.arange(width, dtype=jnp.int32)
        want = dz_tile(f32(l[:, v0:v0 + width]), cols, *common)
        assert_close(got, want, store, f"dz from saved probs, columns {v0}:{v0 + width}")


# --- Pallas TPU kernels in interpret mode ------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n,h,v", [(37, 48, 300), (16, 32, 256)])
def test_pallas_tpu_interpret_matches_reference(request, dtype, n, h, v):
    check_against_reference("pallas_tpu", rng_for(request), n, h, v, dtype, config=SMALL_TPU, interpret=True)


def test_pallas_tpu_interpret_options(request):
    rng = rng_for(request)
    check_against_reference("pallas_tpu", rng, 13, 32, 200, jnp.float32, with_entropy=False, temperature=1.0,
                            config=SMALL_TPU, interpret=True)
    check_against_reference("pallas_tpu", rng, 13, 32, 100, jnp.bfloat16, lm_head_f32=True, config=SMALL_TPU,
                            interpret=True)


# --- Triton kernels under Triton's interpreter --------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
                    reason="needs triton and torch (Triton's CPU interpreter runs on torch tensors)")
def test_triton_kernels_in_interpreter():
    run_interpreter_script(os.path.join(HERE, "triton_interpret_logprobs.py"))


# --- dispatch -------------------------------------------------------------------------------


def test_unknown_impl_lists_available():
    x = jnp.zeros((2, 4))
    with pytest.raises(ValueError, match="available: 'auto', 'reference', 'xla', 'pallas_tpu', 'triton'"):
        logprobs.token_logprobs(x, jnp.zeros((4, 8)), jnp.zeros((2,), jnp.int32), impl="nope")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the off-GPU error")
def test_triton_off_gpu_is_a_clear_error():
    from jrl.kernels._dispatch import ImplUnavailable

    with pytest.raises(ImplUnavailable, match="cannot run here.*Runnable"):
        logprobs.token_logprobs(jnp.zeros((2, 4)), jnp.zeros((4, 8)), jnp.zeros((2,), jnp.int32), impl="triton")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU choice")
def test_auto_picks_xla_on_cpu_and_logs_once(request, caplog):
    rng = rng_for(request)
    hidden, lm_head, targets, *_ = make_inputs(rng, 7, 8, 91, jnp.float32)
    with caplog.at_level(logging.DEBUG, logger="jrl.kernels"):
        lp1, _ = logprobs.token_logprobs(hidden, lm_head, targets)
        lp2, _ = logprobs.token_logprobs(hidden, lm_head, targets)
    lines = [r.getMessage() for r in caplog.records if "logprobs" in r.getMessage() and "(7, 8)" in r.getMessage()]
    assert len(lines) == 1 and "'xla'" in lines[0], lines
    assert_close(lp1, reference.token_logprobs(hidden, lm_head, targets)[0], jnp.float32)


def test_existing_callers_signature(request):
    """grpo_loss calls token_logprobs(hidden, lm_head, targets, temperature=, with_entropy=)."""
    rng = rng_for(request)
    hidden, lm_head, targets, *_ = make_inputs(rng, 6, 8, 50, jnp.float32)
    lp, ent = logprobs.token_logprobs(hidden, lm_head, targets, temperature=0.9, with_entropy=True)
    assert lp.shape == (6,) and ent.shape == (6,)
    lp, ent = logprobs.token_logprobs(hidden, lm_head, targets)
    assert ent is None


# --- GPU: the real kernels on the device --------------------------------------------------------

GPU_SHAPES = [(1000, 256, 5003), (77, 128, 151)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n,h,v", GPU_SHAPES)
@pytest.mark.parametrize("impl,kw", [("triton", {}), ("triton", {"bwd": "xla"}), ("triton_saveprobs", {}), ("xla", {})],
                         ids=["triton", "triton-bwdxla", "triton_saveprobs", "xla"])
def test_gpu_matches_reference(request, impl, kw, dtype, n, h, v):
    extra = {}
    if impl.startswith("triton"):
        from jrl.kernels.logprobs import triton as lp_triton

        extra["config"] = lp_triton.Config(**kw, chunk_v=2048)
    check_against_reference(impl, rng_for(request), n, h, v, dtype, **extra)


@pytest.mark.gpu
@pytest.mark.parametrize("with_entropy", [False, True])
def test_gpu_triton_options(request, with_entropy):
    from jrl.kernels.logprobs import triton as lp_triton

    rng = rng_for(request)
    check_against_reference("triton", rng, 300, 256, 3001, jnp.bfloat16, with_entropy=with_entropy,
                            temperature=1.0)
    check_against_reference("triton", rng, 300, 256, 3001, jnp.bfloat16, with_entropy=with_entropy,
                            lm_head_f32=True)
    saving = lp_triton.Config(save_probs=True)
    check_against_reference("triton", rng, 300, 256, 3001, jnp.bfloat16, with_entropy=with_entropy,
                            temperature=1.0, config=saving)
    check_against_reference("triton", rng, 300, 256, 3001, jnp.bfloat16, with_entropy=with_entropy,
                            lm_head_f32=True, config=saving)


@pytest.mark.gpu
def test_gpu_triton_save_probs_large_logits(request):
    """Saved probabilities stay accurate when logits are large (|l| ~ 30): they are stored as exp(l - m),
    not as logits, whose bf16 rounding would cost percent-level errors in p."""
    from jrl.kernels.logprobs import triton as lp_triton

    rng = rng_for(request)
    hidden, lm_head, *_ = make_inputs(rng, 200, 128, 2000, jnp.bfloat16, scale=2.5)
    assert float(jnp.max(jnp.abs(reference.logits_f32(hidden, lm_head)))) > 20, "inputs too tame for this test"
    check_against_reference("triton", rng, 200, 128, 2000, jnp.bfloat16, temperature=1.0, scale=2.5,
                            config=lp_triton.Config(save_probs=True))


@pytest.mark.gpu
def test_gpu_auto_picks_triton():
    from jrl.kernels import _dispatch

    name, _ = _dispatch.select("logprobs", logprobs.api.IMPLS, logprobs.api.ORDER, "auto")
    assert name == "triton"


@pytest.mark.gpu
def test_gpu_triton_under_vmap_and_grad(request):
    """jax-triton has no batching rule; the wrappers loop over a vmapped batch (as grpo_loss does)."""
    rng = rng_for(request)
    b, n, h, v = 3, 50, 128, 1000
    hidden = jnp.asarray(rng.standard_normal((b, n, h)), jnp.bfloat16)
    lm_head = jnp.asarray(rng.standard_normal((h, v)) / 8, jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, v, (b, n)), jnp.int32)

    def loss(impl):
        def f(hh, w):
            lp, ent = jax.vmap(lambda x, t: logprobs.token_logprobs(x, w, t, with_entropy=True, impl=impl))(hh, targets)
            return jnp.sum(lp) + 0.5 * jnp.sum(ent), lp
        return jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(hidden, lm_head)

    (_, lp), (dh, dw) = loss("triton")
    (_, lp_r), (dh_r, dw_r) = loss("reference")
    assert_close(lp, lp_r, jnp.bfloat16, "vmap logprobs")
    assert_close(dh, dh_r, jnp.bfloat16, "vmap d hidden")
    assert_close(dw, dw_r, jnp.bfloat16, "vmap d lm_head")
