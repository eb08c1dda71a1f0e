"""One expert-parallel device's work between its collectives (``expert_parallel.own_experts``), in one process: the
devices' partial sums add up to every expert's routed output (float32), each device's mask marks exactly the
(token, expert) rows routed to its experts, and a token none of whose experts are on a device gets zero there."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.models.expert_parallel import own_experts, routed

E, K, H, T = 8, 2, 16, 24


def _experts(rows, counts, w, rows_in_use=None):
    """Expert e multiplies its rows by w[e] (rows sorted by expert, ``counts`` per expert, rows past them zero)."""
    assert rows_in_use is None or int(rows_in_use) == int(jnp.sum(counts))
    ends = jnp.cumsum(counts)
    expert = jnp.searchsorted(ends, jnp.arange(rows.shape[0]), side="right")
    live = expert < w.shape[0]
    return jnp.where(live[:, None], jnp.einsum("rh,rhg->rg", rows, w[jnp.minimum(expert, w.shape[0] - 1)]), 0)


@pytest.mark.parametrize("ep", [2, 4])
def test_the_devices_partial_sums_add_up_to_every_experts_output(ep):
    rng = np.random.default_rng(ep)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((E, H, H)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]), jnp.int32)
    ids = ids.at[0].set(jnp.array([0, 1], jnp.int32))  # token 0's experts both on device 0
    weights = jnp.asarray(rng.random((T, K)), jnp.float32)
    want = routed(x, weights, ids, E, lambda rows, counts: _experts(rows, counts, w), dtype=jnp.float32)
    local = E // ep
    total = jnp.zeros_like(want)
    for device in range(ep):
        y, mine = own_experts(x, weights, ids, _experts, (w[device * local:(device + 1) * local],), device=device,
                              local_count=local, rows=None)
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(ids) // local == device)
        if device:
            assert float(jnp.abs(y[0]).max()) == 0.0  # none of token 0's experts is here
        total = total + y
    assert bool(jnp.all(jnp.isfinite(total)))
    err = float(jnp.abs(total - want).max() / jnp.abs(want).max())
    assert err <= 1e-5, err


@pytest.mark.gpu
@pytest.mark.parametrize("lora", [False, True], ids=["experts", "lora_experts"])
def test_gpu_expert_parallel_devices_add_up_to_the_layer_with_kernels(lora):
    """On the GPU kernels (grouped matmuls, row gathers and SwiGLU leaving the rows past the groups unwritten): the
    partial sums of four emulated expert-parallel devices and their gradients equal one device's layer over every
    expert (bf16), with LoRA on the experts too. Memory freed after being filled with NaN first, so that a read of an
    unwritten row would show."""
    from flax import nnx

    from jrl.models import ModelConfig
    from jrl.models.lora import ExpertsLoRA
    from jrl.models.moe import Experts

    e, k, h, i, t, ep = 16, 4, 256, 128, 512, 4
    config = ModelConfig(model_type="qwen3_moe", vocab_size=128, hidden_size=h, intermediate_size=h,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=128, qk_norm=True,
                         num_experts=e, num_experts_per_tok=k, moe_intermediate_size=i, dtype="bfloat16",
                         param_dtype="bfloat16")
    experts = Experts(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    if lora:  # the Bs random (not PEFT's zeros) so that every adapter has a gradient
        experts = ExpertsLoRA(experts, gate_up=True, down=True, rank=8, scale=2.0, key=jax.random.key(1))
        for b in (experts.lora_gate_b, experts.lora_up_b, experts.lora_down_b):
            b[...] = jnp.asarray(rng.standard_normal(b[...].shape) / 8, b[...].dtype)
    params, _ = experts.arrays()
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), jnp.int32)
    weights = jnp.asarray(rng.random((t, k)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)

    @jax.jit
    def layer(x, params):
        return jax.vjp(lambda x_, p_: routed(x_, weights, ids, e, lambda r, c: experts.compute(r, c, *p_),
                                             dtype=jnp.float32), x, params)[1](dy)

    @jax.jit
    def devices(x, params):
        def total(x_, p_):
            local = e // ep
            return sum(own_experts(x_, weights, ids, experts.compute, tuple(w[d * local:(d + 1) * local] for w in p_),
                                   device=d, local_count=local, rows=None)[0] for d in range(ep))
        return jax.vjp(total, x, params)[1](dy)

    want = layer(x, params)
    jax.block_until_ready(jnp.full((256, 1024, 1024), jnp.nan, jnp.float32)).delete()
    got = devices(x, params)
    names = ["d x", "d gate", "d up", "d down"] + ["d gate_up A", "d gate B", "d up B", "d down A", "d down B"] * lora
    assert len(jax.tree.leaves(got)) == len(names)
    for name, g, w in zip(names, jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.isfinite(g).all(), name
        err = np.linalg.norm(g - w) / np.linalg.norm(w)
        assert err <= 1e-2, (name, err)
