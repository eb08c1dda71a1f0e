"""Remat policies give the gradient of the plain forward (float32), and an unknown name is refused. Two
policies are checked (nothing saved; weight matmuls saved), on stacked (scanned) and unrolled layers: the
others differ only in the policy function handed to the same ``jax.checkpoint`` wrapper."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jrl.models.config import ModelConfig
from jrl.models.remat import ACCELERATOR_DEFAULT, REMAT_NAMES, resolve
from jrl.models.transformer import create_model

CONFIG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def _grads(remat: str, scan_layers: bool):
    model = create_model(dataclasses.replace(CONFIG, remat=remat, scan_layers=scan_layers), seed=0)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 64, (2, 16)), jnp.int32)
    mask = jnp.asarray(np.arange(16)[None] >= np.array([[0], [5]]), jnp.int32)

    def loss(m):
        return jnp.mean(jax.nn.log_softmax(m(ids, attention_mask=mask))[..., 3])

    return nnx.state(nnx.grad(loss)(model), nnx.Param)


@pytest.mark.parametrize("scan_layers", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_policies_match_no_remat(scan_layers):
    want = jax.tree.leaves(_grads("none", scan_layers))
    for name in ("full", "dots_with_no_batch_dims_saveable"):
        assert name in REMAT_NAMES
        got = jax.tree.leaves(_grads(name, scan_layers))
        for g, w in zip(got, want, strict=True):
            err = float(jnp.max(jnp.abs(g - w)) / jnp.maximum(jnp.max(jnp.abs(w)), 1e-30))
            assert err <= 1e-5, f"remat={name}: relative gradient error {err:.2e}"


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="ModelConfig.remat='sometimes'"):
        dataclasses.replace(CONFIG, remat="sometimes")


def test_auto_keeps_everything_on_cpu_and_names_a_policy_elsewhere():
    assert jax.default_backend() == "cpu" and resolve("auto") == "none"
    assert ACCELERATOR_DEFAULT in REMAT_NAMES and resolve("full") == "full"
