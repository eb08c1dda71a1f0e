"""Rematerialisation policies for a decoder layer: what the backward pass may keep from the forward.

``none`` keeps every intermediate (fastest, most memory); ``full`` keeps only the layer's input and
recomputes the rest; the others name :mod:`jax.checkpoint_policies` entries (``dots_saveable`` keeps
matmul outputs, ``dots_with_no_batch_dims_saveable`` only those of the weight matmuls, so the attention
scores are recomputed).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

REMAT_POLICIES: dict[str, Callable | None] = {
    "full": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload_dots_with_no_batch_dims": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}
REMAT_NAMES = ("none", *REMAT_POLICIES)


def remat_layer(fn: Callable, name: str) -> Callable:
    """``fn(layer, *args)`` under the named policy (``fn`` itself for ``none``)."""
    if name == "none":
        return fn
    return nnx.remat(fn, policy=REMAT_POLICIES[name], prevent_cse=True)
