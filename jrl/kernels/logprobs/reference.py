"""Pure-JAX per-token logprobs and entropy: the truth the fused kernels are tested against.

Materializes the full ``[N, V]`` logits in float32; fine for tests and small vocabularies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def logits_f32(hidden: jax.Array, lm_head: jax.Array, *, lm_head_f32: bool = False) -> jax.Array:
    """``hidden @ lm_head`` accumulated in float32.

    With ``lm_head_f32`` both operands are upcast to float32 and multiplied at full float32
    precision (no bf16/tf32 rounding of the operands); otherwise the operands keep their dtype
    (promoted to a common one) and only the accumulation is float32.
    """
    if lm_head_f32:
        return jnp.dot(hidden.astype(jnp.float32), lm_head.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    cdt = jnp.promote_types(hidden.dtype, lm_head.dtype)
    precision = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else None
    return jnp.dot(hidden.astype(cdt), lm_head.astype(cdt), precision=precision,
                   preferred_element_type=jnp.float32)


def token_logprobs(
    hidden: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    lm_head_f32: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """Logprob of ``targets`` [N] under softmax(hidden [N, H] @ lm_head [H, V] / temperature).

    Returns (logprobs [N] float32, entropy [N] float32 or None). ``targets`` must lie in [0, V).
    ``lm_head_f32``: compute the logits matmul in full float32 (see :func:`logits_f32`).
    """
    logits = logits_f32(hidden, lm_head, lm_head_f32=lm_head_f32) / temperature
    logz = jax.nn.logsumexp(logits, axis=-1)
    target_logits = jnp.take_along_axis(logits, targets[:, None].astype(jnp.int32), axis=-1)[:, 0]
    logp = target_logits - logz
    if not with_entropy:
        return logp, None
    probs = jnp.exp(logits - logz[:, None])
    entropy = logz - jnp.sum(probs * logits, axis=-1)
    return logp, entropy
