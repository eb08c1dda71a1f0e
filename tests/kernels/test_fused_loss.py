"""The loss-fused LM head against full logits + autodiff on fresh random inputs: a token-level clipped
loss, a sequence-level (GSPO-like) loss with an entropy term, chunkings that split the rows differently,
float32 and bfloat16."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.kernels.logprobs import fused_head_loss
from jrl.kernels.logprobs.fused_loss import rows_per_chunk
from kernels_testlib import assert_close, rng_for


@pytest.fixture(autouse=True)
def _full_precision_matmuls():
    """float32 matmuls in float32 on GPU too (not TF32), so the float32 tolerance applies."""
    with jax.default_matmul_precision("float32"):
        yield


@dataclasses.dataclass(frozen=True)
class TokenClip:
    """-min(r A, clip(r) A) per token, summed and divided by the step's token count (DAPO-like)."""

    def __call__(self, lp, ent, rows, num_tokens):
        ratio = jnp.exp(lp - rows["old"])
        a = rows["adv"][:, None]
        per = -jnp.minimum(ratio * a, jnp.clip(ratio, 0.8, 1.28) * a)
        return jnp.sum(per * rows["mask"]) / num_tokens


@dataclasses.dataclass(frozen=True)
class SequenceWithEntropy:
    """exp(mean log-ratio of the row) · A per row, minus an entropy bonus."""

    coef: float = 0.3

    def __call__(self, lp, ent, rows, num_tokens):
        m = rows["mask"]
        n = jnp.maximum(m.sum(-1), 1.0)
        seq_ratio = jnp.exp(jnp.sum((lp - rows["old"]) * m, -1) / n)
        return -jnp.sum(seq_ratio * rows["adv"]) / 4.0 - self.coef * jnp.sum(ent * m) / num_tokens


def _problem(rng, r, t, h, v, dtype):
    hidden = jnp.asarray(rng.standard_normal((r, t, h)), dtype)
    w = jnp.asarray(rng.standard_normal((h, v)) / np.sqrt(h), dtype)
    y = jnp.asarray(rng.integers(0, v, (r, t)), jnp.int32)
    mask = (np.arange(t)[None] < rng.integers(1, t + 1, r)[:, None]).astype(np.float32)
    rows = {"old": jnp.asarray(rng.standard_normal((r, t)) * 0.1 - np.log(v), jnp.float32),
            "adv": jnp.asarray(rng.standard_normal(r), jnp.float32), "mask": jnp.asarray(mask)}
    return hidden, w, y, rows, jnp.asarray(mask.sum(), jnp.float32)


def _reference(hidden, w, y, rows, aux, row_loss, temperature, with_entropy):
    def f(hidden, w):
        logits = jnp.einsum("rth,hv->rtv", hidden, w, preferred_element_type=jnp.float32) / temperature
        logp = jax.nn.log_softmax(logits, -1)
        lp = jnp.take_along_axis(logp, y[..., None], -1)[..., 0]
        ent = -jnp.sum(jnp.exp(logp) * logp, -1) if with_entropy else None
        return row_loss(lp, ent, rows, aux), lp

    (loss, lp), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(hidden, w)
    return loss, lp, grads


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("row_loss,with_entropy", [(TokenClip(), False), (SequenceWithEntropy(), True)],
                         ids=["token", "sequence+entropy"])
def test_fused_head_matches_full_logits(request, dtype, row_loss, with_entropy):
    rng = rng_for(request)
    r, t, h, v = 6, 7, 32, 300
    hidden, w, y, rows, aux = _problem(rng, r, t, h, v, dtype)
    temperature = float(rng.uniform(0.6, 1.2))
    ref_loss, ref_lp, (ref_dh, ref_dw) = _reference(hidden, w, y, rows, aux, row_loss, temperature, with_entropy)
    # The loss sums terms of both signs; its error is measured against the size of those terms (the same loss
    # with |advantages|), not against a sum that may nearly cancel.
    scale = abs(float(_reference(hidden, w, y, {**rows, "adv": jnp.abs(rows["adv"])}, aux, row_loss, temperature,
                                 with_entropy)[0]))
    # 1, 3 and all 6 whole rows per chunk; rows split into 9 chunks of 5 tokens (the last one padded), 3 of 14 (at
    # most 16) and one of all 42.
    for chunk_tokens, max_row_tokens in ((t, t), (3 * t, t), (10_000, t), (5, t - 1), (16, t - 1), (10_000, t - 1)):
        def f(hidden, w):
            loss, lp, _ = fused_head_loss(hidden, w, y, row_loss, rows, aux, temperature=temperature,
                                          with_entropy=with_entropy, chunk_tokens=chunk_tokens,
                                          max_row_tokens=max_row_tokens)
            return loss, lp

        (loss, lp), (dh, dw) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(hidden, w)
        what = f"{type(row_loss).__name__} chunk_tokens={chunk_tokens} max_row_tokens={max_row_tokens}"
        assert dh.dtype == hidden.dtype and dw.dtype == w.dtype
        tol = 1e-5 if dtype == jnp.float32 else 1e-2
        assert np.isfinite(float(loss)) and abs(float(loss) - float(ref_loss)) <= tol * scale, (
            f"{what} loss {float(loss)} vs {float(ref_loss)} (term scale {scale})")
        assert_close(lp, ref_lp, dtype, f"{what} logp")
        assert_close(dh, ref_dh, dtype, f"{what} d hidden")
        assert_close(dw, ref_dw, dtype, f"{what} d head")


def test_a_row_longer_than_max_row_tokens_keeps_the_logits_of_one_chunk():
    """A row of 4,096 tokens over a 4,096-token vocabulary: whole, the compiled gradient holds its [4096, V] float32
    logits (64 MiB); split into chunks of 256 tokens, XLA's temporary buffers stay under 1/4 of that."""
    r, t, h, v = 1, 4096, 16, 4096
    hidden, w = jax.ShapeDtypeStruct((r, t, h), jnp.float32), jax.ShapeDtypeStruct((h, v), jnp.float32)
    y = jnp.zeros((r, t), jnp.int32)
    rows = {"old": jnp.zeros((r, t)), "adv": jnp.ones(r), "mask": jnp.ones((r, t))}

    def temp_bytes(max_row_tokens):
        def loss(hidden, w):
            return fused_head_loss(hidden, w, y, SequenceWithEntropy(), rows, jnp.float32(t), with_entropy=True,
                                   chunk_tokens=256, max_row_tokens=max_row_tokens)[0]

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden, w).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    logits = t * v * 4
    whole, split = temp_bytes(t), temp_bytes(t - 1)
    assert whole >= logits, (whole, logits)
    assert split < logits / 4, (split, logits)


def test_cotangent_scales_the_gradient(request):
    rng = rng_for(request)
    hidden, w, y, rows, aux = _problem(rng, 2, 5, 16, 50, jnp.float32)

    def f(hidden):
        return 3.0 * fused_head_loss(hidden, w, y, TokenClip(), rows, aux)[0]

    def ref(hidden):
        return 3.0 * _reference(hidden, w, y, rows, aux, TokenClip(), 1.0, False)[0]

    assert_close(jax.grad(f)(hidden), jax.grad(ref)(hidden), jnp.float32, "3 x loss")


def test_rows_per_chunk():
    assert rows_per_chunk(8, 768, 2048) == 2
    assert rows_per_chunk(8, 4096, 2048) == 1
    assert rows_per_chunk(6, 100, 10_000) == 6
    assert rows_per_chunk(7, 100, 500) == 1  # 7 is prime: single rows


def test_one_pass_logsumexp_and_entropy_match_their_definitions(request):
    """The online (one-reduction) log-sum-exp and entropy against jax.nn.logsumexp and -Σ p log p, on rows of
    ordinary, widely spread (±3e4) and constant logits, an odd vocabulary size."""
    from jrl.kernels.logprobs.fused_loss import _logsumexp_entropy

    rng = rng_for(request)
    logits = rng.standard_normal((6, 1001)).astype(np.float32) * np.array([1, 5, 30, 3e4, 0, 1], np.float32)[:, None]
    logits[5, 17] = 40.0  # one dominant entry
    x = jnp.asarray(logits)
    lse, ent = jax.jit(_logsumexp_entropy, static_argnums=1)(x, True)
    want_lse = jax.nn.logsumexp(x, axis=-1)
    p = jax.nn.softmax(x, axis=-1)
    want_ent = -jnp.sum(jnp.where(p > 0, p * jnp.log(p), 0.0), axis=-1)
    assert_close(lse, want_lse, jnp.float32, "logsumexp")
    np.testing.assert_allclose(np.asarray(ent), np.asarray(want_ent), rtol=1e-5, atol=1e-4)
    only, none = jax.jit(_logsumexp_entropy, static_argnums=1)(x, False)
    assert none is None and bool(jnp.all(only == lse))
