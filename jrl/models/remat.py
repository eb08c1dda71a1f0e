"""Rematerialisation policies for a decoder layer: what the backward pass may keep from the forward.

``none`` keeps every intermediate (fastest, most memory); ``full`` keeps only the layer's input and
recomputes the rest; the others name :mod:`jax.checkpoint_policies` entries (``dots_saveable`` keeps
matmul outputs, ``dots_with_no_batch_dims_saveable`` only those of the weight matmuls, so the attention
scores are recomputed). ``auto`` is ``dots_with_no_batch_dims_saveable`` on a GPU or TPU and ``none`` on CPU:
on an H100 a 1B model's scanned train step keeps 16 GiB instead of 28 GiB with it and is 10% faster, since
the elementwise work it recomputes fuses into the backward's kernels (``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

REMAT_POLICIES: dict[str, Callable | None] = {
    "full": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload_dots_with_no_batch_dims": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}
REMAT_NAMES = ("auto", "none", *REMAT_POLICIES)
ACCELERATOR_DEFAULT = "dots_with_no_batch_dims_saveable"


def resolve(name: str) -> str:
    """The policy ``name`` stands for on the default backend (``auto`` resolved)."""
    if name != "auto":
        return name
    return "none" if jax.default_backend() == "cpu" else ACCELERATOR_DEFAULT


def remat(fn: Callable, name: str, *, prevent_cse: bool = True) -> Callable:
    """``fn`` (a pure function of a layer's parameters and inputs) under the named policy; ``fn`` itself for
    ``none``. ``prevent_cse=False`` inside ``jax.lax.scan``, which already keeps XLA from merging the
    recomputation into the forward."""
    name = resolve(name)
    if name == "none":
        return fn
    return jax.checkpoint(fn, policy=REMAT_POLICIES[name], prevent_cse=prevent_cse)
