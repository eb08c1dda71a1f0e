"""The gathered layout of shared prompts (:mod:`jrl.kernels.attention.gathered`): moving a row's tokens in and the
outputs back gives what ``take_along_axis`` gives, values and gradients (whose transposes are scatter-adds), on fresh
random layouts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels.attention.gathered import collapse_rows, expand_rows
from kernels_testlib import rng_for


def _random_layout(rng, rows: int, width: int, most: int, padding: int):
    """(expand [B, E], copies [B, T, C], real [B, E]): each column held 1..``most`` times at random positions, then
    ``padding`` positions reading the last column that its copies do not list (as a packed row's layout padding)."""
    held = rng.integers(1, most + 1, (rows, width))
    layout = int(held.sum(axis=1).max()) + padding
    c = 1 << (most - 1).bit_length()
    expand = np.full((rows, layout), width - 1, np.int32)
    copies = np.full((rows, width, c), layout, np.int32)
    real = np.zeros((rows, layout), bool)
    for r in range(rows):
        columns = np.repeat(np.arange(width), held[r])
        at = np.sort(rng.permutation(layout - padding)[:len(columns)])
        expand[r, at] = rng.permutation(columns)
        real[r, at] = True
        for col in range(width):
            where = at[expand[r, at] == col]
            copies[r, col, :len(where)] = where
    return expand, copies, real


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_expand_and_collapse_match_take_along_axis_with_gradients(request, dtype, tol):
    rng = rng_for(request)
    expand, copies, real = _random_layout(rng, rows=3, width=40, most=5, padding=7)
    x = jnp.asarray(rng.normal(size=(3, 40, 2, 4)), dtype)
    weights = jnp.asarray(rng.normal(size=(3, expand.shape[1], 2, 4)) * real[:, :, None, None], jnp.float32)
    mix = jnp.asarray(rng.normal(size=(4, 4)), jnp.float32)

    def take(a, index):
        return jnp.take_along_axis(a, jnp.asarray(index)[:, :, None, None], axis=1)

    def loss(x, into, back):  # a position-wise map over the layout between the two moves, as the attention is
        inside = into(x).astype(jnp.float32)
        out = back(jnp.tanh(inside @ mix) * weights)
        return jnp.sum(out.astype(jnp.float32) * x.astype(jnp.float32)) + jnp.sum(inside * weights)

    ours = jax.value_and_grad(loss)(x, lambda a: expand_rows(a, expand, copies),
                                    lambda y: collapse_rows(y.astype(dtype), expand, copies))
    reference = jax.value_and_grad(loss)(x, lambda a: take(a, expand), lambda y: take(y.astype(dtype), copies[:, :, 0]))
    for got, want in zip(ours, reference):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    assert np.abs(np.asarray(ours[1], np.float32)).max() > 0
