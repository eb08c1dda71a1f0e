"""GPU grouped matmul on Hopper: the Mosaic GPU kernel (``mosaic_gpu_kernel.py``) for the forward pass and the
input gradient, the Triton kernels (``triton.py``) for the weight gradient and for shapes the Mosaic kernel's
tiles do not fit (:func:`mosaic_gpu_kernel.unsupported_reason`). Needs an NVIDIA Hopper GPU (wgmma) and jax_triton.
"""

from __future__ import annotations

import jax

from jrl.kernels.moe import triton as fallback
from jrl.kernels.moe.mosaic_gpu_kernel import gmm_call, unsupported_reason


def unavailable_reason() -> str | None:
    reason = fallback.unavailable_reason()  # a GPU at all
    if reason:
        return reason
    cc = getattr(next(d for d in jax.devices() if d.platform == "gpu"), "compute_capability", "")
    if cc != "9.0":
        return f"needs a Hopper GPU (compute capability 9.0; wgmma), found {cc or 'unknown'}"
    return None


def _call(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, cfgs, fill_past_groups):
    """The Mosaic kernel where it takes the operands, else the Triton one."""
    if unsupported_reason(lhs.shape, lhs.dtype, rhs.shape, rhs.dtype, transpose_rhs=transpose_rhs) is None:
        return gmm_call(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, out_dtype=out_dtype,
                        fill_past_groups=fill_past_groups)
    return fallback.configured_gmm_call(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, out_dtype=out_dtype,
                                        cfgs=cfgs, fill_past_groups=fill_past_groups)


gmm = fallback.differentiable_gmm(_call)
gmm.__doc__ = ("Grouped matmul (same contract as ``reference.gmm``), differentiable wrt ``lhs`` and ``rhs``; "
               "``configs`` are the Triton tiles for what runs there.")
tgmm = fallback.tgmm
