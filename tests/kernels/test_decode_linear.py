"""``residual + h @ w``, ``silu(h @ w_gate) * (h @ w_up)`` and ``h @ [w_1 | w_2 | ...]`` of a decode step
(``jrl.kernels.decode_linear``)
against the reference on fresh random inputs: row counts below and between Triton's 16, with and without a
split contraction, float32 and bf16. CPU: ``pallas_gpu`` in Pallas interpret mode. GPU (``-m gpu``): the
compiled kernels at a sampler's shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels.decode_linear import matmul_add, matmul_concat, matmul_swiglu
from jrl.kernels.decode_linear.pallas_gpu import DEFAULTS, FEW_ROWS, FEW_ROWS_DEFAULTS, config
from kernels_testlib import assert_close, lower_for, rng_for


@pytest.fixture
def full_precision():
    """float32 references in float32, as the kernels compute them (XLA's GPU matmuls take float32 as TF32)."""
    with jax.default_matmul_precision("float32"):
        yield


def _inputs(rng, m, k, n, dtype):
    h = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    return h, w, jnp.asarray(rng.standard_normal((m, n)), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,k,n,split_k", [(5, 128, 64, 1), (20, 256, 96, 2), (16, 256, 32, 4)])
def test_pallas_interpret_matches_reference(request, dtype, m, k, n, split_k):
    h, w, res = _inputs(rng_for(request), m, k, n, dtype)
    ref = matmul_add(h, w, res, impl="reference")
    out = matmul_add(h, w, res, impl="pallas_gpu", split_k=split_k, block_k=32, block_n=32, interpret=True)
    assert out.dtype == res.dtype and out.shape == res.shape
    assert_close(out, ref, dtype, f"matmul_add m={m} split_k={split_k}")
    # the product alone, so that a kernel that got it wrong cannot hide behind a large residual
    zero = jnp.zeros_like(res)
    assert_close(matmul_add(h, w, zero, impl="pallas_gpu", split_k=split_k, block_k=32, block_n=32, interpret=True),
                 matmul_add(h, w, zero, impl="reference"), dtype, "product")


def test_unsupported_sizes_fall_back_or_name_the_reason():
    h, w, res = jnp.ones((300, 64)), jnp.ones((64, 32)), jnp.ones((300, 32))
    with pytest.raises(RuntimeError, match="300 rows"):
        matmul_add(h, w, res, impl="pallas_gpu")
    assert_close(matmul_add(h, w, res), matmul_add(h, w, res, impl="reference"), jnp.float32, "auto")
    with pytest.raises(RuntimeError, match="not multiples"):
        matmul_add(jnp.ones((4, 96)), jnp.ones((96, 32)), jnp.ones((4, 32)), impl="pallas_gpu", block_k=64)
    with pytest.raises(ValueError, match=r"h \[M, K\], w \[K, N\]"):
        matmul_add(jnp.ones((4, 8)), jnp.ones((9, 4)), jnp.ones((4, 4)))


def test_config_fits_shared_memory_and_the_contraction():
    assert config(64, 2048, 2048)["block_k"] == 256  # the measured default at a sampler's 64 rows
    big = config(256, 8192, 2048)
    assert 2 * big["num_stages"] * big["block_k"] * (256 + big["block_n"]) <= 220 * 1024
    assert config(16, 64, 64)["split_k"] == 1  # one contraction block: nothing to split
    # a float32 model's blocks take twice the bytes: a shorter contraction block (at 64 rows the bfloat16 one asked
    # for more shared memory than an H200 has, a runtime error at the first decode step)
    wide = config(64, 2048, 2048, itemsize=4)
    assert wide["block_k"] == 128 and 4 * wide["num_stages"] * wide["block_k"] * (64 + wide["block_n"]) <= 220 * 1024
    # a few rows (up to FEW_ROWS after padding) take their own blocks, more rows the defaults
    few, many = config(FEW_ROWS, 2048, 2048), config(FEW_ROWS + 1, 2048, 2048)
    assert {k: few[k] for k in FEW_ROWS_DEFAULTS} == FEW_ROWS_DEFAULTS
    assert {k: many[k] for k in DEFAULTS} == DEFAULTS


@pytest.mark.gpu
@pytest.mark.usefixtures("full_precision")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m,k,n", [(64, 2048, 2048), (64, 8192, 2048), (33, 8192, 2048), (7, 6144, 2048)])
def test_gpu_kernel_matches_reference(request, m, k, n, dtype):
    h, w, res = _inputs(rng_for(request), m, k, n, dtype)
    zero = jnp.zeros_like(res)
    assert_close(matmul_add(h, w, zero, impl="pallas_gpu"), matmul_add(h, w, zero, impl="reference"),
                 dtype, "compiled product")
    assert_close(matmul_add(h, w, res, impl="pallas_gpu"), matmul_add(h, w, res, impl="reference"),
                 dtype, "compiled matmul_add")


def _swiglu_inputs(rng, m, k, n, dtype):
    h = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w_gate, w_up = (jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype) for _ in range(2))
    return h, w_gate, w_up


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,k,n", [(5, 128, 64), (20, 256, 96), (64, 64, 32)])
def test_swiglu_interpret_matches_reference(request, dtype, m, k, n):
    h, w_gate, w_up = _swiglu_inputs(rng_for(request), m, k, n, dtype)
    ref = matmul_swiglu(h, w_gate, w_up, impl="reference")
    out = matmul_swiglu(h, w_gate, w_up, impl="pallas_gpu", block_k=32, block_n=32, interpret=True)
    assert out.dtype == h.dtype and out.shape == (m, n)
    assert_close(out, ref, dtype, f"matmul_swiglu m={m} k={k} n={n}")


def test_swiglu_refuses_what_it_cannot_do():
    h, w = jnp.ones((4, 64)), jnp.ones((64, 32))
    with pytest.raises(ValueError, match="does not split"):
        matmul_swiglu(h, w, w, impl="pallas_gpu", split_k=2)
    with pytest.raises(ValueError, match=r"w_gate = w_up \[K, N\]"):
        matmul_swiglu(h, w, w[:, :16])
    with pytest.raises(RuntimeError, match="300 rows"):
        matmul_swiglu(jnp.ones((300, 64)), w, w, impl="pallas_gpu")


@pytest.mark.gpu
@pytest.mark.usefixtures("full_precision")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m,k,n", [(64, 2048, 8192), (33, 2048, 6144), (7, 2048, 8192)])
def test_gpu_swiglu_kernel_matches_reference(request, m, k, n, dtype):
    h, w_gate, w_up = _swiglu_inputs(rng_for(request), m, k, n, dtype)
    assert_close(matmul_swiglu(h, w_gate, w_up, impl="pallas_gpu"), matmul_swiglu(h, w_gate, w_up, impl="reference"),
                 dtype, "compiled matmul_swiglu")


def _concat_inputs(rng, m, k, widths, dtype):
    h = jnp.asarray(rng.standard_normal((m, k)), dtype)
    return h, [jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype) for n in widths]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,k,widths,split_k", [(5, 128, (64, 32, 32), 1), (20, 256, (96, 32, 32), 2),
                                                 (16, 256, (32,), 4), (3, 128, (32, 64), 2)])
def test_concat_interpret_matches_reference(request, dtype, m, k, widths, split_k):
    h, weights = _concat_inputs(rng_for(request), m, k, widths, dtype)
    ref = matmul_concat(h, weights, impl="reference")
    out = matmul_concat(h, weights, impl="pallas_gpu", split_k=split_k, block_k=32, block_n=32, interpret=True)
    assert out.dtype == h.dtype and out.shape == (m, sum(widths))
    assert_close(out, ref, dtype, f"matmul_concat m={m} widths={widths} split_k={split_k}")
    # each weight's product in its own columns
    at = np.cumsum((0,) + widths)
    for w, a, b in zip(weights, at[:-1], at[1:]):
        assert_close(out[:, a:b], matmul_add(h, w, jnp.zeros((m, b - a), dtype), impl="reference"), dtype,
                     f"columns {a}:{b}")


def test_concat_casts_wider_weights_to_the_rows_dtype(request):
    """float32 weights (a model whose parameters are kept in float32) times bfloat16 rows: products in bfloat16."""
    h, weights = _concat_inputs(rng_for(request), 16, 128, (64, 32), jnp.float32)
    h = h.astype(jnp.bfloat16)
    out = matmul_concat(h, weights, impl="pallas_gpu", split_k=2, block_k=32, block_n=32, interpret=True)
    assert out.dtype == jnp.bfloat16
    assert_close(out, matmul_concat(h, weights, impl="reference"), jnp.bfloat16, "float32 weights")


def test_concat_refuses_what_it_cannot_do():
    h = jnp.ones((4, 64))
    with pytest.raises(RuntimeError, match="columns 64, 48 are not multiples"):
        matmul_concat(h, [jnp.ones((64, 64)), jnp.ones((64, 48))], impl="pallas_gpu", block_n=32)
    with pytest.raises(RuntimeError, match="300 rows"):
        matmul_concat(jnp.ones((300, 64)), [jnp.ones((64, 32))], impl="pallas_gpu")
    with pytest.raises(ValueError, match=r"weights \[K, N_i\]"):
        matmul_concat(h, [jnp.ones((64, 32)), jnp.ones((32, 32))])
    ragged = [jnp.ones((64, 64)), jnp.ones((64, 48))]  # auto: the reference where the kernel cannot run
    assert_close(matmul_concat(h, ragged), matmul_concat(h, ragged, impl="reference"), jnp.float32, "auto")


@pytest.mark.gpu
@pytest.mark.usefixtures("full_precision")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m,k,widths", [(16, 2048, (2048, 512, 512)), (64, 2048, (2048, 1024, 1024)),
                                        (7, 4096, (4096, 1024, 1024)), (33, 2048, (2048, 256, 256))])
def test_gpu_concat_kernel_matches_reference(request, m, k, widths, dtype):
    h, weights = _concat_inputs(rng_for(request), m, k, widths, dtype)
    assert_close(matmul_concat(h, weights, impl="pallas_gpu"), matmul_concat(h, weights, impl="reference"),
                 dtype, "compiled matmul_concat")


@pytest.mark.parametrize("m,k,n", [(64, 2048, 2048), (5, 2048, 8192)])
def test_the_kernels_lower_for_cuda(m, k, n):
    """Both kernels' Triton lowering at a 1B model's decode shapes with their default blocks (runs on CPU;
    compiling the result needs a GPU)."""
    from jrl.kernels.decode_linear import pallas_gpu

    h, w = jnp.zeros((m, k), jnp.bfloat16), jnp.zeros((k, n), jnp.bfloat16)
    add = lower_for("cuda", lambda *a: pallas_gpu.matmul_add(*a, interpret=False), h, w, jnp.zeros((m, n), h.dtype))
    swiglu = lower_for("cuda", lambda *a: pallas_gpu.matmul_swiglu(*a, interpret=False), h, w, w)
    concat = lower_for("cuda", lambda h, *w: pallas_gpu.matmul_concat(h, w, interpret=False), h, w,
                       jnp.zeros((k, 512), h.dtype))
    assert "jrl_matmul_add" in add and "jrl_matmul_swiglu" in swiglu and "jrl_matmul_concat" in concat
