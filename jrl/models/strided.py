"""The strided EBFT layout (docs/algorithms/ebft.md §9.2) as pure index math: anchors, blocks, the packed row, its mask.

A document ``x_0 .. x_{S-1}`` is right-padded (index = position; ``S_valid`` real tokens). With context
``c``, stride ``s`` and generation length ``g``, block ``j`` has its anchor at ``a_j = a_0 + j·s``; it is
conditioned on the window ``x[a_j - c, a_j)`` and its ground-truth continuation is ``x[a_j, a_j + g)``.
``a_0 = c`` for plain documents and ``max(c, prompt_len + min_completion_prefix)`` for structured data
(prompt + completion), so there are ``⌊(S - g - a_0)/s⌋ + 1`` blocks, and block ``j`` is valid only while
``a_j + g <= S_valid``.

The packed row is ``[x_0 .. x_{S-1} | ŷ^0_0 .. ŷ^0_{g-1} | … | ŷ^{J-1}_0 .. ŷ^{J-1}_{g-1}]`` (length
``S + J·g``); the position id of ``ŷ^j_k`` is ``a_j + k``. Every token has a *role*: its block (``-1`` for a
document token) and its index (the document index, or the offset ``k`` inside its block). The attention
rule :func:`allowed` is written on roles, so the packed training row and the sampler's KV cache (which
stores the same tokens in another slot order) use one definition:

- document query, document key: ``k <= q`` (causal);
- block-``j`` query, document key: the key is in the window ``[a_j - c, a_j)``;
- block-``j`` query at offset ``u``, block key: same block and offset ``v <= u``.

Nothing else is allowed: documents never see generated tokens and blocks never see each other. The token
``ŷ^j_0`` is predicted by the document token ``x_{a_j - 1}`` (causal over the whole prefix, as in the
document pass of the sampler), ``ŷ^j_u`` for ``u >= 1`` by ``ŷ^j_{u-1}`` (:func:`prediction_indices`).

Ground-truth blocks are laid out and masked exactly like generated ones (:func:`ground_truth_blocks` fills
the block slots of a row with ``x[a_j, a_j + g)``), so both sides of the feature comparison share the same
conditioning.

Every function here is jnp, batched over the leading dimension and jit-able (integers that set shapes,
``seq_len``, ``num_blocks``, ``generate_len``, are static).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

#: Block id of a document token.
DOC = -1


def first_anchors(context_length: int, *, batch: int | None = None, prompt_lengths=None,
                  min_completion_prefix: int = 0) -> jax.Array:
    """``a_0`` [B] int32: ``c`` for plain documents (give ``batch``), ``max(c, prompt_len +
    min_completion_prefix)`` for structured rows (give ``prompt_lengths`` [B])."""
    if prompt_lengths is None:
        if batch is None:
            raise ValueError("first_anchors needs batch= (plain documents) or prompt_lengths= (structured data)")
        return jnp.full((batch,), context_length, jnp.int32)
    p = jnp.asarray(prompt_lengths, jnp.int32)
    return jnp.maximum(context_length, p + min_completion_prefix).astype(jnp.int32)


def num_blocks(seq_len: int, first_anchor: int, stride: int, generate_len: int) -> int:
    """``⌊(S - g - a_0)/s⌋ + 1`` blocks fit a row of ``seq_len`` tokens (0 when not even one does)."""
    room = int(seq_len) - int(generate_len) - int(first_anchor)
    return room // int(stride) + 1 if room >= 0 else 0


def anchors(first: jax.Array, num: int, stride: int) -> jax.Array:
    """``a_j = a_0 + j·s`` [B, J] int32 from ``first`` [B]."""
    return (jnp.asarray(first, jnp.int32)[:, None] + stride * jnp.arange(num, dtype=jnp.int32)[None, :])


def block_valid(anchor: jax.Array, valid_lengths: jax.Array, generate_len: int) -> jax.Array:
    """[B, J] bool: block ``j`` lies inside the unpadded document, ``a_j + g <= S_valid``."""
    return anchor + generate_len <= jnp.asarray(valid_lengths, jnp.int32)[:, None]


def packed_roles(seq_len: int, anchor: jax.Array, generate_len: int):
    """(block id, index, position, anchor of the token's block) each [B, S + J·g] int32 for the packed row.

    Document tokens: block :data:`DOC`, index = position = their document index (anchor 0, unused). Block
    tokens ``ŷ^j_k``: block ``j``, index ``k``, position ``a_j + k``, anchor ``a_j``."""
    b, num = anchor.shape
    j = jnp.repeat(jnp.arange(num, dtype=jnp.int32), generate_len)
    k = jnp.tile(jnp.arange(generate_len, dtype=jnp.int32), num)
    doc = jnp.arange(seq_len, dtype=jnp.int32)
    block = jnp.broadcast_to(jnp.concatenate([jnp.full((seq_len,), DOC, jnp.int32), j]), (b, seq_len + j.size))
    index = jnp.broadcast_to(jnp.concatenate([doc, k]), block.shape)
    block_anchor = jnp.concatenate([jnp.zeros((b, seq_len), jnp.int32), anchor[:, j]], axis=1)
    position = jnp.where(block == DOC, index, block_anchor + index)
    return block, index, position, block_anchor


def allowed(q_block, q_index, q_anchor, k_block, k_index, context_length: int):
    """The §9.2 attention rule on token roles (broadcasting arrays; see the module docstring)."""
    q_block, k_block = jnp.asarray(q_block), jnp.asarray(k_block)
    q_doc, k_doc = q_block == DOC, k_block == DOC
    doc_doc = q_doc & k_doc & (k_index <= q_index)
    block_window = ~q_doc & k_doc & (k_index >= q_anchor - context_length) & (k_index < q_anchor)
    block_block = ~q_doc & (k_block == q_block) & (k_index <= q_index)
    return doc_doc | block_window | block_block


def strided_mask(seq_len: int, anchor: jax.Array, context_length: int, generate_len: int, *,
                 sliding_window: int | None = None) -> jax.Array:
    """Dense boolean mask [B, S + J·g, S + J·g] (query, key) of the packed rows with anchors ``anchor``
    [B, J]; with ``sliding_window`` (the model's) keys must also be within that many positions."""
    block, index, position, block_anchor = packed_roles(seq_len, anchor, generate_len)
    mask = allowed(block[:, :, None], index[:, :, None], block_anchor[:, :, None], block[:, None, :],
                   index[:, None, :], context_length)
    if sliding_window is not None:
        mask = mask & (position[:, :, None] - position[:, None, :] < sliding_window)
    return mask


def pack(doc_ids: jax.Array, blocks: jax.Array) -> jax.Array:
    """The packed rows [B, S + J·g]: documents [B, S] followed by blocks [B, J, g]."""
    b = doc_ids.shape[0]
    return jnp.concatenate([doc_ids, blocks.reshape(b, -1).astype(doc_ids.dtype)], axis=1)


def ground_truth_blocks(doc_ids: jax.Array, anchor: jax.Array, generate_len: int) -> jax.Array:
    """``x[a_j, a_j + g)`` [B, J, g] (indices past the row are clamped; such blocks are invalid anyway)."""
    s = doc_ids.shape[1]
    idx = jnp.clip(anchor[:, :, None] + jnp.arange(generate_len, dtype=jnp.int32), 0, s - 1)
    return jnp.take_along_axis(doc_ids[:, None, :], idx, axis=2)


def block_slots(seq_len: int, num: int, generate_len: int) -> np.ndarray:
    """Packed index ``S + j·g + k`` of ``ŷ^j_k``, [J, g]."""
    return seq_len + np.arange(num * generate_len, dtype=np.int32).reshape(num, generate_len)


def prediction_indices(seq_len: int, anchor: jax.Array, generate_len: int) -> jax.Array:
    """[B, J, g]: the packed index whose output predicts ``ŷ^j_u``: ``a_j - 1`` for ``u = 0`` (a document
    token; clamped to ``S - 1`` for anchors past the row, whose blocks are invalid), ``S + j·g + u - 1``
    after."""
    b, num = anchor.shape
    slots = jnp.asarray(block_slots(seq_len, num, generate_len))
    prev = jnp.broadcast_to(slots - 1, (b, num, generate_len))
    return prev.at[:, :, 0].set(jnp.minimum(anchor - 1, seq_len - 1))
