"""Sequence packing for the learner: whole sequences (a row's prompt and its completion up to the last loss token) laid
end to end in rows of a fixed width with segment ids, so an update computes no padding of short completions.

A packed micro-batch of ``R`` rows of width ``W`` holds up to ``S`` sequences per row. The body of the model runs over
every packed position; the LM head only over each row's *scored* columns (those predicting a loss token, at most
``T`` per row, ``T`` the step's completion width, as in the padded layout, so no head FLOP goes to prompts). The
per-token arrays the loss reads stay in the padded layout, one ``[S, T]`` block per packed row: the loss gathers each
sequence's completion log-probs from the scored columns into ``[R, S, T]`` and runs the padded loss on ``[R·S, T]``,
where an empty sequence slot has no loss token. Log-probs, losses and the gradient are the padded rows' (the attention
inside a segment equals the attention of the padded row; positions restart at 0 in each segment as they start at a
padded row's first real token).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class PackedRows(NamedTuple):
    """``R`` packed rows of width ``W`` holding up to ``S`` sequences each, and their sequences' per-token arrays in the
    padded layout (``T`` completion columns)."""

    input_ids: np.ndarray
    """[R, W] int32: sequences end to end, then padding."""
    segment_ids: np.ndarray
    """[R, W] int32: 1, 2, ... per sequence in the row; the padding after a row's sequences is one more segment (no
    loss reads it), so that every query has a key to attend to (a query with none is NaN on some backends)."""
    scored: np.ndarray
    """[R, T] int32: the columns of each row that predict a completion token of their sequence, in order (0 past the
    row's last)."""
    targets: np.ndarray
    """[R, T] int32: the token each scored column predicts (0 past the row's last)."""
    gather: np.ndarray
    """[R, S, T] int32: the scored column (index into ``scored``) whose log-prob is completion token j of the row's
    sequence s (0 where the slot or the token is not there; such entries have no loss token)."""
    sequence: np.ndarray
    """[R, S] int32: the padded-batch row of each sequence slot (-1 for an empty slot)."""


def loss_extent(mask) -> np.ndarray:
    """[N] the position after each row's last loss token (``mask`` [N, T]; 0 for a row without one): what a row may
    be cut to (later tokens do not change earlier ones' log-probs)."""
    mask = np.asarray(mask) > 0
    return np.where(mask.any(-1), mask.shape[1] - np.argmax(mask[:, ::-1], axis=-1), 0)


def sequence_extents(attention_mask: np.ndarray, completion_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first real column [N], length [N]) of each padded row's sequence: from its first real prompt token to its
    last loss token (later tokens do not change earlier log-probs). ``attention_mask`` [N, Lp + T],
    ``completion_mask`` [N, T]."""
    attention_mask = np.asarray(attention_mask) > 0
    width, t = attention_mask.shape[1], np.shape(completion_mask)[1]
    first = np.argmax(attention_mask, axis=1)
    end = np.maximum(width - t + loss_extent(completion_mask), first + 1)  # a row without a loss token keeps one token
    return first, end - first


def plan_rows(lengths: np.ndarray, width: int, scored: np.ndarray | None = None,
              scored_width: int | None = None) -> list[list[int]]:
    """The sequences of each packed row (indices into ``lengths``): first fit, longest first, rows of ``width``
    tokens and, with ``scored``, of at most ``scored_width`` scored columns (each sequence's count in ``scored``)."""
    lengths = np.asarray(lengths)
    scored = np.zeros_like(lengths) if scored is None else np.asarray(scored)
    scored_width = int(scored.max(initial=0)) if scored_width is None else scored_width
    rows: list[list[int]] = []
    room: list[list[int]] = []  # per row: tokens left, scored columns left
    for i in np.argsort(-lengths, kind="stable").tolist():
        need, score = int(lengths[i]), int(scored[i])
        if need > width or score > scored_width:
            raise ValueError(f"a sequence of {need} tokens ({score} scored) does not fit a packed row of {width} "
                             f"({scored_width} scored)")
        for r, (free, free_scored) in enumerate(room):
            if free >= need and free_scored >= score:
                rows[r].append(i)
                room[r] = [free - need, free_scored - score]
                break
        else:
            rows.append([i])
            room.append([width - need, scored_width - score])
    return rows


def pack(input_ids: np.ndarray, attention_mask: np.ndarray, completion_mask: np.ndarray, *,
         rows_multiple: int | None, least_rows: int = 1) -> PackedRows:
    """The padded rows ``input_ids`` / ``attention_mask`` [N, Lp + T] (left-padded prompts, right-padded completions of
    ``T`` = ``completion_mask.shape[1]`` columns) packed into rows of the same width (padding: token 0);
    the row count padded with empty rows to a multiple of ``rows_multiple`` (None: a power of two, at least
    ``least_rows``, e.g. the batch's shards on a mesh) and the sequences per row to a power of two, so that few
    shapes compile."""
    input_ids = np.asarray(input_ids)
    n, width = input_ids.shape
    t = np.asarray(completion_mask).shape[1]
    prompt_width = width - t
    first, lengths = sequence_extents(attention_mask, completion_mask)
    # Completion token j sits at padded column prompt_width + j and is predicted by the column before it, which is in
    # the sequence from j0 on (j0 = 1 only for a row without a prompt token): tokens j0 .. j0 + scored - 1 are scored.
    j0 = np.maximum(first + 1 - prompt_width, 0)
    scored = np.maximum(lengths - (prompt_width - first) - j0, 0)
    plan = plan_rows(lengths, width, scored, t)
    r = (1 << (max(len(plan), least_rows) - 1).bit_length() if rows_multiple is None
         else -(-len(plan) // rows_multiple) * rows_multiple)
    s = 1 << (max(len(p) for p in plan) - 1).bit_length()
    ids = np.zeros((r, width), np.int32)
    segments = np.ones((r, width), np.int32)  # rows past the plan: one segment of padding
    columns = np.zeros((r, t), np.int32)
    targets = np.zeros((r, t), np.int32)
    gather = np.zeros((r, s, t), np.int32)
    sequence = np.full((r, s), -1, np.int32)
    for row, members in enumerate(plan):
        at = done = 0
        for slot, i in enumerate(members):
            size, k = int(lengths[i]), int(scored[i])
            ids[row, at:at + size] = input_ids[i, first[i]:first[i] + size]
            segments[row, at:at + size] = slot + 1
            j = int(j0[i])
            start = at + prompt_width + j - 1 - first[i]  # the column predicting completion token j
            columns[row, done:done + k] = np.arange(start, start + k)
            targets[row, done:done + k] = input_ids[i, prompt_width + j:prompt_width + j + k]
            gather[row, slot, j:j + k] = np.arange(done, done + k)
            sequence[row, slot] = i
            at, done = at + size, done + k
        segments[row, at:] = len(members) + 1
    return PackedRows(ids, segments, columns, targets, gather, sequence)


def per_sequence(values: np.ndarray | None, sequence: np.ndarray, fill) -> np.ndarray | None:
    """A padded-batch per-row array ``values`` [N, ...] laid out per sequence slot [R, S, ...] (``fill`` in empty
    slots)."""
    if values is None:
        return None
    values = np.asarray(values)
    out = values[np.maximum(sequence, 0)]
    empty = (sequence < 0).reshape(sequence.shape + (1,) * (values.ndim - 1))
    return np.where(empty, np.asarray(fill, values.dtype), out)
