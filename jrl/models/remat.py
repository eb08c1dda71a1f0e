"""Rematerialisation policies for a decoder layer: what the backward pass may keep from the forward.

``none`` keeps every intermediate (fastest, most memory); ``full`` keeps only the layer's input and
recomputes the rest; the others name :mod:`jax.checkpoint_policies` entries (``dots_saveable`` keeps
matmul outputs, ``dots_with_no_batch_dims_saveable`` only those of the weight matmuls, so the attention
scores are recomputed). ``dots_and_attention_saveable`` also keeps what a fused attention kernel's forward
hands its backward (the cuDNN flash attention's output and softmax statistics), so the backward does not
run the attention forward again. ``auto`` is ``dots_and_attention_saveable`` on a GPU,
``dots_with_no_batch_dims_saveable`` on a TPU and ``none`` on CPU: on an H100 a 1B model's scanned train
step keeps 16 GiB instead of 28 GiB with the dots policy and is 10% faster, since the elementwise work it
recomputes fuses into the backward's kernels, and keeping the attention's outputs (0.5 GiB more) saves the
second attention forward of every layer (``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jrl.kernels import backend as kernel_backend

#: Primitives whose outputs are a fused attention forward's results (cuDNN flash attention through
#: ``jax.nn.dot_product_attention``): its output and softmax statistics, the residuals its backward reads.
ATTENTION_FORWARD_PRIMITIVES = ("dot_product_attention_fwd", "dot_product_attention_fwd_wrapper")


def dots_and_attention_saveable(prim, *avals, **params) -> bool:
    """Keep the weight matmuls' outputs (as ``dots_with_no_batch_dims_saveable``) and the fused attention
    forward's outputs."""
    return (prim.name in ATTENTION_FORWARD_PRIMITIVES
            or jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *avals, **params))


REMAT_POLICIES: dict[str, Callable | None] = {
    "full": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots_and_attention_saveable": dots_and_attention_saveable,
    "offload_dots_with_no_batch_dims": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}
REMAT_NAMES = ("auto", "none", *REMAT_POLICIES)
#: What ``auto`` picks per backend (CPU: ``none``).
ACCELERATOR_DEFAULT = {"gpu": "dots_and_attention_saveable", "tpu": "dots_with_no_batch_dims_saveable"}


def resolve(name: str) -> str:
    """The policy ``name`` stands for on the default backend (``auto`` resolved)."""
    if name != "auto":
        return name
    return ACCELERATOR_DEFAULT.get(kernel_backend(), "none")


def remat(fn: Callable, name: str, *, prevent_cse: bool = True) -> Callable:
    """``fn`` (a pure function of a layer's parameters and inputs) under the named policy; ``fn`` itself for
    ``none``. ``prevent_cse=False`` inside ``jax.lax.scan``, which already keeps XLA from merging the
    recomputation into the forward."""
    name = resolve(name)
    if name == "none":
        return fn
    return jax.checkpoint(fn, policy=REMAT_POLICIES[name], prevent_cse=prevent_cse)
