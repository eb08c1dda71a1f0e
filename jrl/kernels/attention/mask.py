"""Which keys each query may attend to, in structured form, so fused kernels never need a dense mask.

A training forward is self-attention over one row of ``S`` tokens (query ``i`` and key ``j`` index the
same row). Key ``j`` is allowed for query ``i`` when every rule that is on holds:

- causal: ``j <= i``;
- segments: ``kv_segments[j] == q_segments[i]`` and ``kv_segments[j] != 0`` (0 marks padding; a packed
  row gives each document its own id);
- sliding window: ``i - j < sliding_window`` (on indices: within one contiguous segment, the
  positions the model derives differ exactly as the indices do);
- explicit: ``explicit[i, j]`` (an arbitrary boolean mask, e.g. the strided EBFT layout).

Outputs at padding queries (segment 0) are unspecified but finite: implementations may differ there,
nothing downstream reads them. ``contiguous`` promises that each row's non-zero segment is one run
(left and/or right padding, no packing); kernels that work on per-row lengths rely on it. ``starts_at_zero``
promises more: that run starts at index 0 in every row (right padding only), so a kernel that handles only
trailing padding needs no per-row shift (:func:`roll_rows` moves a left-padded row's run there). ``max_segments``
promises of a packed row that each segment (padding included) is one contiguous run and that a row has at most that
many runs; kernels that take packed rows as a list of runs (cuDNN's packed layout) need the bound at trace time.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jrl.kernels.attention.gathered import take_rows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMask:
    q_segments: jax.Array
    """[B, T] int32 segment of each query (0 = padding)."""
    kv_segments: jax.Array
    """[B, S] int32 segment of each key (0 = padding, never attended)."""
    explicit: jax.Array | None = None
    """[B, T, S] bool, ANDed with the other rules (None = no explicit mask)."""
    expand: jax.Array | None = None
    """[B, E] int32: attention over a gathered layout (packed rows with shared prompts): position ``e`` of it is the
    row's token ``expand[e]`` (queries, keys and values gathered), the segments and every rule apply to that layout
    ([B, E]), and token ``i`` of the row takes the output of position ``copies[i, 0]``. None: the row itself."""
    copies: jax.Array | None = None
    """[B, T, C] int32, with ``expand``: the gathered positions holding each token of the row, the one whose output
    it takes first, then its repeats (E past the last; :mod:`jrl.kernels.attention.gathered`)."""
    causal: bool = dataclasses.field(default=True, metadata=dict(static=True))
    sliding_window: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    contiguous: bool = dataclasses.field(default=False, metadata=dict(static=True))
    starts_at_zero: bool = dataclasses.field(default=False, metadata=dict(static=True))
    max_segments: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    @classmethod
    def padded(cls, attention_mask: jax.Array, *, sliding_window: int | None = None,
               starts_at_zero: bool = False) -> AttentionMask:
        """Causal attention over the real tokens of ``attention_mask`` [B, S] (1 = token), whose real
        tokens form one run per row (left and/or right padding; with ``starts_at_zero`` the caller promises
        right padding only)."""
        seg = attention_mask.astype(jnp.int32)
        return cls(seg, seg, causal=True, sliding_window=sliding_window, contiguous=True,
                   starts_at_zero=starts_at_zero)

    @classmethod
    def packed(cls, segment_ids: jax.Array, attention_mask: jax.Array | None = None, *,
               sliding_window: int | None = None, max_segments: int | None = None) -> AttentionMask:
        """Causal attention within documents: ``segment_ids`` [B, S] (each document one contiguous run),
        padding where ``attention_mask`` is 0. ``max_segments``: the caller's bound on the runs of a row, padding
        runs included (:attr:`max_segments`)."""
        seg = segment_ids.astype(jnp.int32) + 1  # user ids may start at 0; 0 is reserved for padding
        if attention_mask is not None:
            seg = jnp.where(attention_mask.astype(bool), seg, 0)
        return cls(seg, seg, causal=True, sliding_window=sliding_window, max_segments=max_segments)

    @classmethod
    def full_causal(cls, batch: int, seq_len: int, *, sliding_window: int | None = None) -> AttentionMask:
        """Causal attention over rows with no padding."""
        seg = jnp.ones((batch, seq_len), jnp.int32)
        return cls(seg, seg, causal=True, sliding_window=sliding_window, contiguous=True, starts_at_zero=True)

    @classmethod
    def from_dense(cls, mask: jax.Array) -> AttentionMask:
        """Exactly the boolean mask [B, T, S] (query, key); no other rule."""
        b, t, s = mask.shape
        return cls(jnp.ones((b, t), jnp.int32), jnp.ones((b, s), jnp.int32), explicit=mask.astype(bool),
                   causal=False)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.q_segments.shape[0], self.q_segments.shape[1], self.kv_segments.shape[1])

    def block(self, q_start, q_len: int, k_start, k_len: int) -> jax.Array:
        """The allowed-matrix [B, q_len, k_len] of queries ``q_start ..`` against keys ``k_start ..``
        (starts may be traced; the slices must lie inside the row)."""
        q_seg = jax.lax.dynamic_slice_in_dim(self.q_segments, q_start, q_len, axis=1)
        k_seg = jax.lax.dynamic_slice_in_dim(self.kv_segments, k_start, k_len, axis=1)
        allowed = (q_seg[:, :, None] == k_seg[:, None, :]) & (k_seg[:, None, :] != 0)
        qi = q_start + jnp.arange(q_len, dtype=jnp.int32)
        kj = k_start + jnp.arange(k_len, dtype=jnp.int32)
        if self.causal:
            allowed = allowed & (kj[None, None, :] <= qi[None, :, None])
        if self.sliding_window is not None:
            allowed = allowed & (qi[None, :, None] - kj[None, None, :] < self.sliding_window)
        if self.explicit is not None:
            rows = jax.lax.dynamic_slice_in_dim(self.explicit, q_start, q_len, axis=1)
            allowed = allowed & jax.lax.dynamic_slice_in_dim(rows, k_start, k_len, axis=2)
        return allowed

    def row_segments(self) -> jax.Array:
        """[B, T] the segment of each query token of the row (with ``expand``: its gathered position's)."""
        if self.expand is None:
            return self.q_segments
        return take_rows(self.q_segments, self.copies[:, :, 0])

    def gathered(self) -> AttentionMask:
        """This mask over its gathered layout (``expand``), as a mask of that layout's own rows."""
        return dataclasses.replace(self, expand=None, copies=None)

    def dense(self) -> jax.Array:
        """The whole allowed-matrix [B, T, S]."""
        _, t, s = self.shape
        return self.block(0, t, 0, s)


def segment_starts(segments: jax.Array) -> jax.Array:
    """[..., S] bool: where a run of equal ids in ``segments`` [..., S] begins (index 0 and every change of id)."""
    return jnp.concatenate([jnp.ones_like(segments[..., :1], bool), segments[..., 1:] != segments[..., :-1]],
                           axis=-1)


def segment_runs(segments: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
    """(start [B, M], length [B, M]) int32 of each row's runs of equal ids in ``segments`` [B, S], in order, ``M`` =
    ``max_segments``; -1 in both past a row's last run (runs beyond ``M`` are dropped: the caller's bound)."""
    run = jnp.cumsum(segment_starts(segments), axis=1, dtype=jnp.int32) - 1  # [B, S] the run of each index
    ids = jnp.arange(max_segments, dtype=jnp.int32)
    length = jnp.sum(run[:, :, None] == ids, axis=1, dtype=jnp.int32)  # [B, M]
    start = jnp.cumsum(length, axis=1, dtype=jnp.int32) - length
    there = length > 0
    return jnp.where(there, start, -1), jnp.where(there, length, -1)


def run_starts(real: jax.Array) -> jax.Array:
    """[B] int32: the index of each row's first true entry of ``real`` [B, S] (0 for a row with none)."""
    return jnp.where(jnp.any(real, axis=1), jnp.argmax(real, axis=1), 0).astype(jnp.int32)


def _rotate(x: jax.Array, shift: jax.Array) -> jax.Array:
    """Row r of x [B, S, ...] rotated left by ``shift[r]`` (a gather)."""
    s = x.shape[1]
    idx = (jnp.arange(s, dtype=jnp.int32)[None, :] + shift[:, None]) % s
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


@jax.custom_vjp
def roll_rows(x: jax.Array, shift: jax.Array) -> jax.Array:
    """Row r of x [B, S, ...] rotated left by ``shift[r]`` [B] int32, so index ``shift[r]`` moves to 0; its
    gradient is the opposite rotation (another gather), not the scatter-add autodiff makes of a gather: a
    rotation is a permutation, so its transpose is its inverse. ``roll_rows(y, (S - shift) % S)`` undoes it."""
    return _rotate(x, shift)


def _roll_rows_fwd(x, shift):
    return _rotate(x, shift), shift


def _roll_rows_bwd(shift, g):
    return _rotate(g, (g.shape[1] - shift) % g.shape[1]), None


roll_rows.defvjp(_roll_rows_fwd, _roll_rows_bwd)
