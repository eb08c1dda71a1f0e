"""Per-token logprob dispatcher: picks an implementation by backend with an ordered fallback."""

from __future__ import annotations

import jax

from jrl.kernels.logprobs import reference


def token_logprobs(
    hidden: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array | None]:
    """Logprob (and optionally entropy) of ``targets`` from hidden states and the lm head [H, V]."""
    if impl not in ("auto", "reference"):
        raise ValueError(f"unknown logprobs impl {impl!r}; available: 'auto', 'reference'")
    return reference.token_logprobs(hidden, lm_head, targets, temperature=temperature, with_entropy=with_entropy)
