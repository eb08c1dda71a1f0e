"""Logit parity of every family against transformers' PyTorch implementation (float32, CPU).

Bounds: max |logit diff| <= 1e-4 and mean per-token KL(hf || jrl) <= 1e-6; on a plain batch, on a
left-padded batch (non-pad positions), for all hidden states, and for a packed row against its documents.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from model_testlib import FAMILIES, VOCAB, hf_logits, jrl_hidden, jrl_logits, kl_mean

pytest.importorskip("torch", reason="parity tests need torch (pip install -e '.[dev]')")

MAX_DIFF, MAX_KL = 1e-4, 1e-6


def _check(ref, out, what):
    diff = float(np.abs(np.asarray(out) - ref).max())
    kl = kl_mean(ref, np.asarray(out))
    assert diff <= MAX_DIFF, f"{what}: max |logit diff| {diff:.3g} > {MAX_DIFF}"
    assert kl <= MAX_KL, f"{what}: mean KL {kl:.3g} > {MAX_KL}"
    return diff, kl


def test_logits(family, ids, hf_checkpoints, jrl_models):
    hf, path = hf_checkpoints(family)
    model = jrl_models(family, path)
    diff, kl = _check(hf_logits(hf, ids), jrl_logits(model, ids), family)
    print(f"\n{family}: float32 max|diff|={diff:.3g} KL={kl:.3g}")


def test_left_padded(family, hf_checkpoints, jrl_models):
    hf, path = hf_checkpoints(family)
    model = jrl_models(family, path)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, VOCAB, size=(3, 16)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :5] = 0
    mask[2, :11] = 0
    ids[mask == 0] = 0
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    ref = hf_logits(hf, ids, attention_mask=mask, position_ids=positions)
    out = jrl_logits(model, ids, attention_mask=mask)  # positions derived from the mask
    real = mask.astype(bool)
    _check(ref[real], out[real], f"{family} left-padded")
    # A left-padded row equals the same tokens right-padded (same shapes: no recompilation).
    ids2, mask2 = np.zeros_like(ids), np.zeros_like(mask)
    ids2[0, :5], mask2[0, :5] = ids[2, 11:], 1
    np.testing.assert_allclose(out[2, 11:], jrl_logits(model, ids2, attention_mask=mask2)[0, :5], atol=2e-5, rtol=0)


def test_packed_row_matches_documents(family, hf_checkpoints, jrl_models):
    _, path = hf_checkpoints(family)
    model = jrl_models(family, path)
    rng = np.random.default_rng(2)
    lengths = [5, 7, 4]
    docs = [rng.integers(0, VOCAB, size=(1, n)).astype(np.int32) for n in lengths]
    packed = np.concatenate(docs, axis=1)
    segments = np.concatenate([np.full((1, n), i + 1, np.int32) for i, n in enumerate(lengths)], axis=1)
    out = jrl_logits(model, np.repeat(packed, 3, 0), segment_ids=np.repeat(segments, 3, 0))[0]
    # Each document alone, right-padded to the row length (positions from the mask start at 0).
    alone_ids, alone_mask = np.zeros((3, 16), np.int32), np.zeros((3, 16), np.int32)
    for i, doc in enumerate(docs):
        alone_ids[i, :doc.shape[1]], alone_mask[i, :doc.shape[1]] = doc[0], 1
    alone = jrl_logits(model, alone_ids, attention_mask=alone_mask)
    start = 0
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(out[start:start + n], alone[i, :n], atol=2e-5, rtol=0)
        start += n


def test_hidden_states_follow_transformers(family, ids, hf_checkpoints, jrl_models):
    """Entry 0 = embeddings, entry i = layer i-1 output, last entry = after the final norm (as HF)."""
    import torch

    hf, path = hf_checkpoints(family)
    model = jrl_models(family, path)
    with torch.no_grad():
        ref = hf(torch.tensor(ids), output_hidden_states=True).hidden_states
    final, layers = jrl_hidden(model, ids)
    assert len(layers) == len(ref) == model.config.num_hidden_layers + 1
    for i, (a, b) in enumerate(zip(layers, ref, strict=True)):
        np.testing.assert_allclose(np.asarray(a), b.numpy(), atol=1e-4, rtol=1e-5, err_msg=f"hidden state {i}")
    np.testing.assert_array_equal(np.asarray(final), np.asarray(layers[-1]))


def test_selected_hidden_states(hf_checkpoints, jrl_models, ids):
    """A list of indices returns those entries (negative ones count from the end); only the layers up to the
    deepest one asked for run."""
    _, path = hf_checkpoints("llama_tied")
    model = jrl_models("llama_tied", path)
    _, layers = jrl_hidden(model, ids)
    final, some = model.hidden_states(jnp.asarray(ids), return_layers=[1, 0])
    np.testing.assert_allclose(np.asarray(some[0]), np.asarray(layers[1]), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(some[1]), np.asarray(layers[0]))
    np.testing.assert_allclose(np.asarray(final), np.asarray(layers[1]), atol=1e-5)  # stopped after layer 0
    _, last = model.hidden_states(jnp.asarray(ids), return_layers=[-1])
    np.testing.assert_allclose(np.asarray(last[0]), np.asarray(layers[-1]), atol=1e-5)
    with pytest.raises(ValueError, match="outside"):
        model.hidden_states(jnp.asarray(ids), return_layers=[3])


@pytest.mark.parametrize("fam", ["llama_rope3", "qwen3_moe", "qwen2_moe", "glm4_moe", "olmoe"])
def test_bf16_kl(fam, ids, hf_checkpoints, jrl_models):
    """jrl in bfloat16 against transformers in float32: recorded, loosely bounded."""
    hf, path = hf_checkpoints(fam)
    model = jrl_models(fam, path, "bfloat16")
    assert model.embed.embedding[...].dtype == jnp.bfloat16
    ref = hf_logits(hf, ids)
    out = jrl_logits(model, ids)
    assert out.dtype == np.float32
    kl = kl_mean(ref, out)
    print(f"\n{fam}: bf16 vs hf fp32 mean KL={kl:.3g} max|diff|={np.abs(out - ref).max():.3g}")
    assert kl < 1e-2


def test_families_cover_the_brief():
    assert {FAMILIES[f][0] for f in FAMILIES} == {"llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe",
                                                  "glm4_moe", "olmoe"}
