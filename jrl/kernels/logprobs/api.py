"""Per-token logprob dispatcher: picks an implementation by backend with an ordered fallback.

| name         | where                          | what                                                          |
|--------------|--------------------------------|---------------------------------------------------------------|
| `reference`  | anywhere                       | materializes [N, V] float32 logits (the truth)                 |
| `xla`        | anywhere                       | loop over vocab tiles, online logsumexp, custom VJP            |
| `pallas_tpu` | TPU (interpret mode elsewhere) | Pallas/Mosaic fused forward, dh and dW kernels                 |
| `triton`     | NVIDIA GPU + jax_triton        | Triton fused forward; backward per vocab chunk (Triton + cuBLAS)|
| `triton_saveprobs` | NVIDIA GPU + jax_triton  | `triton` with ``save_probs``: no logits recompute in the backward, |
|              |                                | at the cost of an [N, V] buffer in the compute dtype (opt-in)  |

``impl="auto"`` order: TPU: pallas_tpu, xla. GPU: triton, xla. CPU: xla, reference (``auto`` never
picks ``triton_saveprobs``: it trades an [N, V] buffer, N * V * 2 bytes in bf16, for speed, which only the
caller can weigh).
``pallas_tpu`` bakes the temperature into the kernel, so with a traced temperature "auto" skips it.
The pick is logged once per configuration on the ``jrl.kernels`` logger.
"""

from __future__ import annotations

import dataclasses

import jax

from jrl.kernels import _dispatch
from jrl.kernels._dispatch import Impl

IMPLS = {
    "reference": Impl("reference", "jrl.kernels.logprobs.reference", ("cpu", "gpu", "tpu")),
    "xla": Impl("xla", "jrl.kernels.logprobs.xla", ("cpu", "gpu", "tpu")),
    "pallas_tpu": Impl("pallas_tpu", "jrl.kernels.logprobs.pallas_tpu", ("tpu",), interpret_ok=True),
    "triton": Impl("triton", "jrl.kernels.logprobs.triton", ("gpu",)),
    "triton_saveprobs": Impl("triton_saveprobs", "jrl.kernels.logprobs.triton", ("gpu",)),
}
ORDER = {
    "tpu": ("pallas_tpu", "xla", "reference"),
    "gpu": ("triton", "xla", "reference"),
    "cpu": ("xla", "reference"),
    "default": ("xla", "reference"),
}


def available_impls() -> list[str]:
    """Names accepted by ``impl=`` ("auto" plus every implementation)."""
    return ["auto", *IMPLS]


def _is_static_number(x) -> bool:
    try:
        float(x)
        return True
    except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return False


def token_logprobs(
    hidden: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    impl: str = "auto",
    lm_head_f32: bool = False,
    **kwargs,
) -> tuple[jax.Array, jax.Array | None]:
    """Logprob (and optionally entropy) of ``targets`` from hidden states and the lm head [H, V].

    Args:
      hidden: [N, H] final hidden states (bf16 or f32).
      lm_head: [H, V] output projection.
      targets: [N] int token ids in [0, V).
      temperature: logits are divided by it (not differentiated).
      with_entropy: also return the entropy of softmax(logits / temperature).
      impl: "auto" or one of :func:`available_impls`.
      lm_head_f32: run the logits matmul in full float32 (bf16 inputs are upcast inside the kernel;
        no float32 copy of the lm head is made). Slower; for when logprobs must match an f32 head.
      **kwargs: implementation options (``block_v=`` for xla, ``config=`` for triton/pallas_tpu,
        ``interpret=`` for pallas_tpu).

    Returns:
      (logprobs [N] float32, entropy [N] float32 or None). Differentiable wrt ``hidden`` and
      ``lm_head``; the fused implementations never materialize [N, V].
    """
    if hidden.ndim != 2 or lm_head.ndim != 2 or hidden.shape[1] != lm_head.shape[0]:
        raise ValueError(f"token_logprobs needs hidden [N, H] and lm_head [H, V]; got {hidden.shape}, {lm_head.shape}")
    if targets.shape != (hidden.shape[0],):
        raise ValueError(f"targets must be [N]={hidden.shape[0]}, got {targets.shape}")
    static_temp = _is_static_number(temperature)

    def call_check(name):
        if name == "pallas_tpu" and not static_temp:
            return "needs a Python-number temperature (got a traced value)"
        return None

    config = (tuple(hidden.shape), str(hidden.dtype), tuple(lm_head.shape), str(lm_head.dtype),
              f"entropy={with_entropy}", f"lm_head_f32={lm_head_f32}")
    name, mod = _dispatch.select("logprobs", IMPLS, ORDER, impl, config=config, call_check=call_check)
    if name == "triton_saveprobs":
        kwargs["config"] = dataclasses.replace(kwargs.get("config") or mod.Config(), save_probs=True)
    return mod.token_logprobs(hidden, lm_head, targets, temperature=temperature, with_entropy=with_entropy,
                              lm_head_f32=lm_head_f32, **kwargs)
