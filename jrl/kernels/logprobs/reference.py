"""Pure-JAX per-token logprobs and entropy: the truth the fused kernels are tested against.

Materializes the full ``[N, V]`` logits in float32; fine for tests and small vocabularies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_logprobs(
    hidden: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """Logprob of ``targets`` [N] under softmax(hidden [N, H] @ lm_head [H, V] / temperature).

    Returns (logprobs [N] float32, entropy [N] float32 or None).
    """
    logits = jnp.dot(hidden, lm_head, preferred_element_type=jnp.float32) / temperature
    logz = jax.nn.logsumexp(logits, axis=-1)
    target_logits = jnp.take_along_axis(logits, targets[:, None].astype(jnp.int32), axis=-1)[:, 0]
    logp = target_logits - logz
    if not with_entropy:
        return logp, None
    probs = jnp.exp(logits - logz[:, None])
    entropy = logz - jnp.sum(probs * logits, axis=-1)
    return logp, entropy
