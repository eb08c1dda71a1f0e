"""Grouped-matmul dispatcher: picks an implementation by backend with an ordered fallback."""

from __future__ import annotations

import jax

from jrl.kernels.moe import reference


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, impl: str = "auto") -> jax.Array:
    """Grouped matmul ``[T, K] x [E, K, N] -> [T, N]`` over rows sorted by group (see reference.gmm)."""
    if impl not in ("auto", "reference"):
        raise ValueError(f"unknown gmm impl {impl!r}; available: 'auto', 'reference'")
    return reference.gmm(lhs, rhs, group_sizes)
