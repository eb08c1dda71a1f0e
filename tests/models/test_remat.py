"""Remat policies give the gradient of the plain forward (float32), and an unknown name is refused. Three
policies are checked (nothing saved; weight matmuls saved; weight matmuls and attention saved), on stacked
(scanned) and unrolled layers: the others differ only in the policy function handed to the same
``jax.checkpoint`` wrapper. On a GPU, the attention-keeping policy runs the cuDNN attention forward once per
layer, the matmul-only one twice (the backward recomputes it)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jrl.kernels import backend
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


@pytest.mark.parametrize("scan_layers", [True, False])
def test_policies_match_no_remat(scan_layers):
    want = jax.tree.leaves(_grads("none", scan_layers))
    for name in ("full", "dots_with_no_batch_dims_saveable", "dots_and_attention_saveable"):
        assert name in REMAT_NAMES
        got = jax.tree.leaves(_grads(name, scan_layers))
        for g, w in zip(got, want, strict=True):
            err = float(jnp.max(jnp.abs(g - w)) / jnp.maximum(jnp.max(jnp.abs(w)), 1e-30))
            assert err <= 1e-5, f"remat={name}: relative gradient error {err:.2e}"


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="ModelConfig.remat='sometimes'"):
        dataclasses.replace(CONFIG, remat="sometimes")


def test_auto_keeps_everything_on_cpu_and_names_a_policy_elsewhere():
    assert resolve("auto") == ("none" if backend() == "cpu" else ACCELERATOR_DEFAULT[backend()])
    assert set(ACCELERATOR_DEFAULT.values()) <= set(REMAT_NAMES) and resolve("full") == "full"


@pytest.mark.gpu
@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
def test_attention_policy_runs_the_attention_forward_once_per_layer(scan_layers):
    """Counted in the compiled gradient program: cuDNN attention forwards (``__cudnn$fmhaSoftmax`` custom calls), one
    in a scanned layer body or one per unrolled layer with the attention kept, twice that without."""
    config = dataclasses.replace(CONFIG, dtype="bfloat16", head_dim=64, num_attention_heads=4, num_key_value_heads=2,
                                 hidden_size=128, attention="cudnn", scan_layers=scan_layers)
    ids = jnp.ones((2, 128), jnp.int32)
    mask = jnp.asarray(np.arange(128)[None] >= np.array([[0], [5]]), jnp.int32)

    def forwards(policy: str) -> int:
        model = create_model(dataclasses.replace(config, remat=policy), seed=0)
        graphdef, state = nnx.split(model)

        def loss(state):
            return jnp.mean(nnx.merge(graphdef, state)(ids, attention_mask=mask)[..., 3])

        hlo = jax.jit(jax.grad(loss)).lower(state).compile().as_text()
        return hlo.count('custom_call_target="__cudnn$fmhaSoftmax"')

    per_program = 1 if scan_layers else CONFIG.num_hidden_layers
    assert forwards("dots_and_attention_saveable") == per_program
    assert forwards("dots_with_no_batch_dims_saveable") == 2 * per_program
