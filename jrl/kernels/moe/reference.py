"""Pure-JAX grouped matmul: the truth every MoE kernel is tested against."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, preferred_element_type=None) -> jax.Array:
    """Grouped matmul for rows sorted by group.

    ``lhs`` [T, K] holds rows sorted by group, ``rhs`` [E, K, N] one matrix per group, ``group_sizes``
    [E] int32 the number of rows of each group (sum <= T; rows past the sum give zeros).
    Returns [T, N] where row t uses ``rhs[g(t)]``.
    """
    out_dtype = preferred_element_type or lhs.dtype
    return jax.lax.ragged_dot(
        lhs, rhs, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32
    ).astype(out_dtype)
