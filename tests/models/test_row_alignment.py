"""Padded rows run with their real tokens at index 0 (``Transformer.hidden_states`` rolls them there and back):
every hidden state a caller gets, and every gradient, equals the forward of the same rows already right-padded,
and the attention kernels see a mask that promises it (``AttentionMask.starts_at_zero``)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jrl.kernels.attention import AttentionMask
from jrl.models.config import ModelConfig
from jrl.models.transformer import create_model

TINY = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _rows(rng, batch: int, seq: int):
    """(left+right padded ids and mask, the same rows right-padded only, each row's start)."""
    ids = rng.integers(1, 64, (batch, seq)).astype(np.int32)
    starts = rng.integers(0, seq // 2, batch)
    lengths = rng.integers(2, seq // 2, batch)
    mask = ((np.arange(seq)[None] >= starts[:, None]) & (np.arange(seq)[None] < (starts + lengths)[:, None]))
    mask = mask.astype(np.int32)
    ids = ids * mask
    right_ids = np.stack([np.roll(r, -s) for r, s in zip(ids, starts)])
    right_mask = np.stack([np.roll(r, -s) for r, s in zip(mask, starts)])
    return ids, mask, right_ids, right_mask, starts


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_left_padded_rows_equal_right_padded_rows(scan):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    model = create_model(ModelConfig(**TINY, scan_layers=scan), seed=int(rng.integers(1 << 30)))
    ids, mask, right_ids, right_mask, starts = _rows(rng, 4, 16)
    _, got = model.hidden_states(jnp.asarray(ids), attention_mask=jnp.asarray(mask), return_layers=True)
    _, want = model.hidden_states(jnp.asarray(right_ids), attention_mask=jnp.asarray(right_mask), return_layers=True)
    assert len(got) == len(want) == 3
    for layer, (g, w) in enumerate(zip(got, want)):
        for r, s in enumerate(starts):
            real = mask[r].astype(bool)
            np.testing.assert_allclose(np.asarray(g[r])[real], np.roll(np.asarray(w[r]), s, axis=0)[real],
                                       rtol=1e-5, atol=1e-6, err_msg=f"entry {layer}, row {r}")
    # Selected intermediate entries only (layers past the deepest one are not run).
    last, (first,) = model.hidden_states(jnp.asarray(ids), attention_mask=jnp.asarray(mask), return_layers=(1,))
    np.testing.assert_allclose(np.asarray(first)[mask.astype(bool)], np.asarray(got[1])[mask.astype(bool)],
                               rtol=1e-6)

    # Gradients of a loss over the real positions are equal, too (the rotations' gradients are gathers).
    def loss(m, ids, mask):
        h = m.hidden_states(ids, attention_mask=mask)
        return jnp.sum(jnp.where(mask[..., None] != 0, h, 0.0) ** 2)

    g_left = nnx.grad(loss)(model, jnp.asarray(ids), jnp.asarray(mask))
    g_right = nnx.grad(loss)(model, jnp.asarray(right_ids), jnp.asarray(right_mask))
    for a, b in zip(jax.tree.leaves(nnx.state(g_left)), jax.tree.leaves(nnx.state(g_right))):
        assert np.all(np.isfinite(np.asarray(a)))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_the_layers_see_masks_that_start_at_zero():
    """The mask built for a padded forward promises right padding only; packed rows and explicit masks do not."""
    model = create_model(ModelConfig(**TINY), seed=0)
    ids = jnp.ones((2, 8), jnp.int32)
    mask = jnp.asarray(np.arange(8)[None] >= np.array([[0], [3]]), jnp.int32)
    _, padded = model.prepare_inputs(ids, attention_mask=mask, starts_at_zero=True)
    assert padded.starts_at_zero and padded.contiguous
    assert not model.prepare_inputs(ids, attention_mask=mask)[1].starts_at_zero
    assert not model.prepare_inputs(ids, segment_ids=jnp.zeros((2, 8), jnp.int32))[1].starts_at_zero
    assert AttentionMask.full_causal(2, 8).starts_at_zero
    dense = jnp.ones((2, 8, 8), bool)
    assert not model.prepare_inputs(ids, positions=jnp.zeros((2, 8), jnp.int32), mask=dense)[1].starts_at_zero
