"""Random micro-batches for the loss tests (NumPy float64), their conversion to ``LossInputs``, and a loss with its
gradient in float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jrl.losses import LossInputs, grpo_loss


def random_batch(seed: int, b: int = 4, t: int = 6, *, empty_row: bool = True, missing_samp: bool = True) -> dict:
    """Right-padded completions of random length (one empty if asked), tool tokens, NaN sampler entries."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, size=b)
    if empty_row and b > 1:
        lengths[rng.integers(b)] = 0
    cm = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float64)
    tool = (rng.random((b, t)) > 0.15).astype(np.float64)
    lp = -rng.gamma(1.0, 1.0, size=(b, t)) - 0.01
    old = lp + rng.normal(0.0, 0.3, size=(b, t))
    samp = old + rng.normal(0.0, 0.4, size=(b, t))
    if missing_samp:
        samp[rng.random((b, t)) < 0.1] = np.nan
    return {
        "lp": lp,
        "old": old,
        "ref": lp + rng.normal(0.0, 0.3, size=(b, t)),
        "samp": samp,
        "ent": rng.gamma(2.0, 0.5, size=(b, t)),
        "adv": rng.normal(0.0, 1.0, size=b),
        "cm": cm,
        "tool": tool,
        "trunc": rng.random(b) < 0.3,
    }


def to_inputs(batch: dict, dtype=jnp.float64, **overrides) -> LossInputs:
    """``LossInputs`` from a :func:`random_batch` dict (call inside ``jax.enable_x64(True)`` for f64)."""
    a = lambda k: jnp.asarray(batch[k], dtype)  # noqa: E731
    kw = dict(
        advantages=a("adv"),
        completion_mask=a("cm"),
        logprobs=a("lp"),
        old_logprobs=a("old"),
        ref_logprobs=a("ref"),
        sampler_logprobs=a("samp"),
        entropy=a("ent"),
        tool_mask=a("tool"),
        truncated=jnp.asarray(batch["trunc"]),
    )
    kw.update(overrides)
    return LossInputs(**kw)


def ref_kwargs(batch: dict, **overrides) -> dict:
    """Keyword arguments of ``losses_reference_np.loss_ref`` from a batch dict."""
    kw = {k: batch[k] for k in ("lp", "adv", "cm", "old", "ref", "samp", "ent", "tool", "trunc")}
    kw.update(overrides)
    return kw


def loss_and_grad(cfg, lp, old, adv, cm) -> tuple[float, np.ndarray]:
    """(loss, d loss / d lp) of log-probs ``lp`` against ``old`` with advantages ``adv`` and completion mask ``cm``."""
    def loss(x):
        inputs = LossInputs(advantages=jnp.asarray(adv), completion_mask=jnp.asarray(cm), logprobs=x,
                            old_logprobs=jnp.asarray(old))
        return grpo_loss(inputs, cfg)[0]

    with jax.enable_x64(True):
        got, grad = jax.value_and_grad(loss)(jnp.asarray(lp))
    return float(got), np.asarray(grad)
