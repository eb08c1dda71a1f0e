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


def _experts(rows, counts, w):
    """Expert e multiplies its rows by w[e] (rows sorted by expert, ``counts`` per expert, rows past them zero)."""
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
