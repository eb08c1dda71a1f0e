"""The strided EBFT layout and mask (docs/algorithms/ebft.md §9.2 required tests 1, 2, 3 and 5), and the model's explicit
``mask=`` argument: the dense mask equals the written definition for every (query, key) pair, no
information leaks between blocks or from blocks into the document, one packed pass equals J per-block
passes, and block counts / anchors match hand-computed values."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.models import ModelConfig, create_model
from jrl.models import strided as st

TINY = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3)
SLIDING = dict(TINY, model_type="mixtral", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
               sliding_window=5)


def _model(kind="llama", seed=0):
    return create_model(ModelConfig(**(TINY if kind == "llama" else SLIDING)), seed=seed)


def _spec_allowed(q: int, k: int, seq_len: int, anchor: list[int], c: int, g: int) -> bool:
    """§9.2's predicate written on packed indices, one pair at a time."""
    def role(i):
        return ("doc", i) if i < seq_len else ("gen", (i - seq_len) // g, (i - seq_len) % g)

    rq, rk = role(q), role(k)
    if rq[0] == "doc":
        return rk[0] == "doc" and k <= q
    j, u = rq[1], rq[2]
    if rk[0] == "doc":
        return anchor[j] - c <= k < anchor[j]
    return rk[1] == j and rk[2] <= u


def _layout(rng, batch, seq_len, c, s, g, structured, mcp=0):
    """(anchors [B, J], valid [B, J], prompt lengths or None) for random documents."""
    lengths = rng.integers(seq_len // 2, seq_len + 1, batch)
    if structured:
        prompts = rng.integers(1, seq_len // 2, batch)
        first = st.first_anchors(c, prompt_lengths=prompts, min_completion_prefix=mcp)
    else:
        prompts = None
        first = st.first_anchors(c, batch=batch)
    num = max(st.num_blocks(seq_len, int(a), s, g) for a in np.asarray(first))
    anchor = st.anchors(first, num, s)
    return anchor, st.block_valid(anchor, lengths, g), prompts


@pytest.mark.parametrize("structured", [False, True])
def test_mask_equals_definition_for_every_pair(structured):
    rng = np.random.default_rng(1 + structured)
    for seq_len, c, s, g in [(20, 4, 3, 5), (17, 6, 6, 2), (24, 3, 8, 4)]:
        anchor, _, _ = _layout(rng, 3, seq_len, c, s, g, structured, mcp=2)
        mask = np.asarray(jax.jit(st.strided_mask, static_argnums=(0, 2, 3))(seq_len, anchor, c, g))
        length = seq_len + anchor.shape[1] * g  # S + J·g
        assert mask.shape == (3, length, length)
        for b in range(3):
            a = np.asarray(anchor[b]).tolist()
            want = np.array([[_spec_allowed(q, k, seq_len, a, c, g) for k in range(length)] for q in range(length)])
            np.testing.assert_array_equal(mask[b], want)


def test_block_counts_and_anchors_hand_computed():
    # S = 256, c = s = g = 8. Plain: a_0 = 8, ⌊(256 - 8 - 8)/8⌋ + 1 = 31 blocks at 8, 16, ..., 248.
    first = st.first_anchors(8, batch=2)
    assert np.asarray(first).tolist() == [8, 8]
    assert st.num_blocks(256, 8, 8, 8) == 31
    anchor = np.asarray(st.anchors(first, 31, 8))
    assert anchor[0].tolist() == list(range(8, 249, 8))
    # A document of 200 real tokens: blocks with a_j + 8 <= 200, i.e. a_j <= 192: 24 blocks.
    valid = np.asarray(st.block_valid(anchor, np.array([256, 200]), 8))
    assert valid[0].all() and valid[1].sum() == 24 and valid[1, :24].all()
    # Structured: prompt of 37 tokens, min_completion_prefix 8 -> a_0 = max(8, 45) = 45,
    # ⌊(256 - 8 - 45)/8⌋ + 1 = 26 blocks at 45, 53, ..., 245 (245 + 8 = 253 <= 256).
    # A prompt of 3 tokens with prefix 2 keeps a_0 = c = 8.
    first = np.asarray(st.first_anchors(8, prompt_lengths=np.array([37, 3]), min_completion_prefix=8))
    assert first.tolist() == [45, 11]
    first = np.asarray(st.first_anchors(8, prompt_lengths=np.array([37, 3]), min_completion_prefix=2))
    assert first.tolist() == [39, 8]
    assert st.num_blocks(256, 45, 8, 8) == 26
    assert st.num_blocks(20, 45, 8, 8) == 0
    anchor = np.asarray(st.anchors(np.array([45]), 26, 8))
    assert anchor[0, 0] == 45 and anchor[0, -1] == 245
    # 200 real tokens: 45 + 8j + 8 <= 200 -> j <= 18: 19 blocks.
    assert np.asarray(st.block_valid(anchor, np.array([200]), 8)).sum() == 19
    # Positions of the packed row: the document, then a_j + k for block j.
    _, _, pos, _ = st.packed_roles(256, jnp.asarray(anchor), 8)
    pos = np.asarray(pos)[0]
    assert pos[:256].tolist() == list(range(256))
    assert pos[256:264].tolist() == list(range(45, 53)) and pos[-8:].tolist() == list(range(245, 253))


@functools.cache
def _packed_program(model, c, g):
    """Jitted (logits, hidden-state tuple) of packed rows under the strided mask (one per model)."""
    @jax.jit
    def run(doc, blocks, anchor):
        seq_len = doc.shape[1]
        ids = st.pack(doc, blocks)
        _, _, pos, _ = st.packed_roles(seq_len, anchor, g)
        mask = st.strided_mask(seq_len, anchor, c, g, sliding_window=model.config.sliding_window)
        final, layers = model.hidden_states(ids, positions=pos, mask=mask, return_layers=True)
        return model.logits(final), layers

    return run


def _packed_forward(model, doc, blocks, anchor, c, g):
    logits, layers = _packed_program(model, c, g)(jnp.asarray(doc), jnp.asarray(blocks), jnp.asarray(anchor))
    return np.asarray(logits), [np.asarray(h) for h in layers]


def _setup(seed=0, seq_len=20, c=4, s=3, g=4, batch=2, vocab=64):
    rng = np.random.default_rng(seed)
    anchor, _, _ = _layout(rng, batch, seq_len, c, s, g, structured=False)
    doc = rng.integers(0, vocab, (batch, seq_len)).astype(np.int32)
    blocks = rng.integers(0, vocab, (batch, anchor.shape[1], g)).astype(np.int32)
    return rng, doc, blocks, np.asarray(anchor)


def _outputs(logits, layers, idx):
    return [logits[:, idx]] + [h[:, idx] for h in layers]


def _assert_same(a, b):
    """Equal within float32 rounding: max |x - y| <= 1e-5 · max |y| for every output array."""
    for x, y in zip(a, b, strict=True):
        assert np.isfinite(x).all() and np.isfinite(y).all()
        assert np.abs(x - y).max() <= 1e-5 * np.abs(y).max(), np.abs(x - y).max() / np.abs(y).max()


def _assert_changed(a, b):
    assert max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True)) > 1e-3


def test_no_leakage():
    model = _model()
    c, g, seq_len = 4, 4, 20
    rng, doc, blocks, anchor = _setup(c=c, g=g, seq_len=seq_len)
    num = anchor.shape[1]
    slots = st.block_slots(seq_len, num, g)
    base = _packed_forward(model, doc, blocks, anchor, c, g)
    for j in range(num):
        # Document tokens at positions >= a_j do not reach block j (they do change later document outputs).
        a = int(anchor[0, j])
        perturbed = doc.copy()
        perturbed[:, a:] = (doc[:, a:] + 1 + rng.integers(0, 60, doc[:, a:].shape)) % 64
        out = _packed_forward(model, perturbed, blocks, anchor, c, g)
        _assert_same(_outputs(*out, slots[j]), _outputs(*base, slots[j]))
        if a < seq_len:
            _assert_changed(_outputs(*out, np.arange(a, seq_len)), _outputs(*base, np.arange(a, seq_len)))
    for j2 in range(num):
        # Block j2's tokens reach no other block and no document token, but do change block j2 itself.
        perturbed = blocks.copy()
        perturbed[:, j2] = (blocks[:, j2] + 1 + rng.integers(0, 60, blocks[:, j2].shape)) % 64
        out = _packed_forward(model, doc, perturbed, anchor, c, g)
        others = np.concatenate([slots[j] for j in range(num) if j != j2])
        _assert_same(_outputs(*out, others), _outputs(*base, others))
        _assert_same(_outputs(*out, np.arange(seq_len)), _outputs(*base, np.arange(seq_len)))
        _assert_changed(_outputs(*out, slots[j2]), _outputs(*base, slots[j2]))


@pytest.mark.parametrize("kind", ["llama", "sliding"])
def test_single_packed_pass_equals_per_block_passes(kind):
    model = _model(kind, seed=3)
    c, g, seq_len = 4, 4, 20
    _, doc, blocks, anchor = _setup(seed=4, c=c, g=g, seq_len=seq_len)
    logits, layers = _packed_forward(model, doc, blocks, anchor, c, g)
    slots = st.block_slots(seq_len, anchor.shape[1], g)
    for j in range(anchor.shape[1]):
        one_logits, one_layers = _packed_forward(model, doc, blocks[:, j:j + 1], anchor[:, j:j + 1], c, g)
        alone = np.arange(seq_len, seq_len + g)
        _assert_same(_outputs(logits, layers, slots[j]), _outputs(one_logits, one_layers, alone))
        _assert_same(_outputs(logits, layers, np.arange(seq_len)), _outputs(one_logits, one_layers, np.arange(seq_len)))


def test_explicit_mask_reproduces_the_default_mask():
    model = _model(seed=5)
    rng = np.random.default_rng(5)
    ids = jnp.asarray(rng.integers(0, 64, (2, 12)), jnp.int32)
    attention_mask = jnp.asarray(np.arange(12)[None] < np.array([[12], [7]]), jnp.int32)
    positions, structured = model.prepare_inputs(ids, attention_mask=attention_mask)
    mask = structured.dense()
    default = np.asarray(model(ids, attention_mask=attention_mask))
    explicit = np.asarray(model(ids, positions=positions, mask=mask))
    np.testing.assert_allclose(explicit, default, rtol=1e-6, atol=1e-6)
    # A different mask changes the output (the argument is really used).
    causal_only = np.asarray(model(ids, positions=positions, mask=jnp.tril(jnp.ones((2, 12, 12), bool))))
    assert np.abs(causal_only[1, :7] - default[1, :7]).max() < 1e-6
    assert np.abs(causal_only[1, 7:] - default[1, 7:]).max() > 1e-3
    with pytest.raises(ValueError, match="explicit positions"):
        model(ids, mask=mask)
    with pytest.raises(ValueError, match="not both"):
        model(ids, positions=positions, mask=mask, attention_mask=attention_mask)
