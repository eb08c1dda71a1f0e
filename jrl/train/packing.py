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

With shared prompts the sequences of one prompt in a packed row (a GRPO group's ``num_generations`` rows, or as many
of them as fit) hold that prompt once, all but its last token (whose column predicts each sequence's own first
completion token): the projections, MLPs and norms run over each prompt once, a group of ``g`` sequences of prompt
``P`` saves ``(g - 1)(P - 1)`` positions of them. The attention alone runs over every sequence whole: queries, keys
and values are gathered into a wider layout where each sequence's copy of its prompt precedes its own tokens, and
each packed-row column takes the output of its position there (a prompt's: its first copy). The gradient of a
prompt's keys and values sums over its copies, so the loss and gradient stay the padded rows'.
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
    """[R, W] int32 ([R, E] with shared prompts: over ``expand``'s layout): 1, 2, ... per sequence in the row; the
    padding after a row's sequences is one more segment (no loss reads it), so that every query has a key to attend
    to (a query with none is NaN on some backends)."""
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
    positions: np.ndarray | None = None
    """Shared prompts: [R, W] int32, each token's position in its sequence (a shared prompt's from 0, each of its
    sequences' own tokens after it). None: positions restart at 0 in each segment."""
    expand: np.ndarray | None = None
    """Shared prompts: [R, E] int32, the packed-row column each position of the attention's layout reads: every
    sequence laid out whole, its shared prompt repeated before its own tokens (``segment_ids`` [R, E] describe this
    layout). None: the attention runs over the packed row itself."""
    copies: np.ndarray | None = None
    """Shared prompts: [R, W, C] int32, the attention-layout positions holding each packed-row column: the one whose
    output the column takes (a shared prompt's: its first copy), then its repeats, E past the last (C: the most
    sequences sharing a prompt in a row, rounded up to a power of two)."""


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


def plan_rows(sizes, limits) -> list[list[int]]:
    """The sequences of each packed row (indices into ``sizes`` [N, K]: each sequence's tokens, then what else a row
    bounds, such as its scored columns): :func:`first_fit` rows within ``limits`` [K], the most crowded of them
    thinned (:func:`thin_rows`) without adding a row."""
    sizes, limits = np.asarray(sizes).reshape(len(sizes), -1), np.asarray(limits)
    return thin_rows(first_fit(sizes, limits), sizes, limits)


class _Room:
    """What is left of each of ``limits`` [K] in each packed row so far (first fit's bookkeeping)."""

    def __init__(self, limits: np.ndarray):
        self.limits, self.left = limits, np.zeros((0, len(limits)), np.int64)

    def first(self, need: np.ndarray, among: np.ndarray | None = None) -> int | None:
        """The first row (of ``among``'s, a mask over the rows) with room for ``need``; None: none."""
        fits = (self.left >= need).all(axis=1) & (True if among is None else among)
        return int(np.argmax(fits)) if fits.any() else None

    def take(self, row: int | None, need: np.ndarray, what: str) -> int:
        """``need`` taken from ``row`` (None: from a new row, refused where it passes the limits, ``what`` naming the
        sizes); returns the row."""
        if row is None:
            if (need > self.limits).any():
                raise ValueError(f"a sequence of {need.tolist()} ({what}) does not fit a packed row of "
                                 f"{self.limits.tolist()}")
            self.left, row = np.concatenate([self.left, self.limits[None]]), len(self.left)
        self.left[row] -= need
        return row


def first_fit(sizes: np.ndarray, limits: np.ndarray) -> list[list[int]]:
    """Sequences (indices into ``sizes`` [N, K]) in rows, most tokens (column 0) first, each into the first row with
    room for every one of its sizes (``limits`` [K] a row)."""
    rows: list[list[int]] = []
    room = _Room(limits)
    for i in np.argsort(-sizes[:, 0], kind="stable").tolist():
        r = room.take(room.first(sizes[i]), sizes[i], "tokens, scored columns...")
        if r == len(rows):
            rows.append([])
        rows[r].append(i)
    return rows


def thin_rows(rows: list[list[int]], sizes: np.ndarray, limits: np.ndarray) -> list[list[int]]:
    """``rows`` with their most sequences per row halved as a power of two while that can be done by moving one
    sequence to a row with fewer, or swapping two for one, every row within ``limits`` (tokens, scored columns; each
    sequence's in ``sizes`` [N, 2]); the row count stays. First fit leaves the shortest sequences crowded in the last
    rows it fills, and the attention of packed rows costs by the bound on sequences per row (cuDNN's packed layout
    walks every run slot of every row, ~12 us per slot, row and layer for 8,448 positions on an H200), not by the
    sequences themselves: on a long-tailed step (bound 32 -> 16) the update is 1.7-2.4% faster on an H200."""
    rows = [list(r) for r in rows]
    total = sum(len(r) for r in rows)
    while rows:
        target = (1 << (max(len(r) for r in rows) - 1).bit_length()) // 2
        if target < 1 or target * len(rows) < total:
            return rows
        thinner = _at_most(rows, sizes, limits, target)
        if thinner is None:
            return rows
        rows = thinner
    return rows


def _at_most(rows: list[list[int]], sizes: np.ndarray, limits: np.ndarray, target: int) -> list[list[int]] | None:
    """``rows`` rearranged to at most ``target`` sequences each by single moves and two-for-one swaps into rows with
    fewer than ``target`` (shortest sequences first, the first row that takes them), or None where a crowded row
    has neither left."""
    rows = [list(r) for r in rows]
    free = limits[None] - np.stack([sizes[r].sum(axis=0) for r in rows])  # [R, 2]
    for r in range(len(rows)):
        while len(rows[r]) > target:
            open_rows = np.array([len(row) < target for row in rows])
            open_rows[r] = False
            members = sorted(rows[r], key=lambda i: tuple(sizes[i]))
            fits = open_rows[None] & (free[None] >= sizes[members][:, None]).all(axis=2)  # [members, R]
            if fits.any():
                k, q = np.unravel_index(int(np.argmax(fits)), fits.shape)
                take, give = [members[k]], []
            else:
                others = [(q, x) for q in np.flatnonzero(open_rows).tolist() for x in rows[q]]
                swap = _two_for_one(members, others, sizes, free, r)
                if swap is None:
                    return None
                take, (q, x) = swap
                give = [x]
            change = sizes[take].sum(axis=0) - sizes[give].sum(axis=0)  # what row q gains and row r gives up
            for i in take:
                rows[r].remove(i)
            rows[r] += give
            rows[q] = [i for i in rows[q] if i not in give] + take
            free[r] += change
            free[q] -= change
    return rows


def _two_for_one(members: list[int], others: list[tuple[int, int]], sizes: np.ndarray, free: np.ndarray,
                 r: int) -> tuple[list[int], tuple[int, int]] | None:
    """The first two of ``members`` (row ``r``'s, pairs in order of their tokens) that one of ``others`` ((row,
    sequence) pairs) can change places with, each row staying within its ``free`` budgets, and that one."""
    if not others:
        return None
    q_of = np.array([q for q, _ in others])
    x_sizes = sizes[[x for _, x in others]]  # [X, 2]
    pairs = sorted(((a, b) for k, a in enumerate(members) for b in members[k + 1:]),
                   key=lambda ab: tuple(sizes[ab[0]] + sizes[ab[1]]))
    for a, b in pairs:
        change = (sizes[a] + sizes[b])[None] - x_sizes  # [X, 2]
        ok = ((change <= free[q_of]) & (-change <= free[r])).all(axis=1)
        if ok.any():
            return [a, b], others[int(np.argmax(ok))]
    return None


EXPANDED_BUCKET = 256
"""With shared prompts, the attention's layout is wider than a packed row by the prompts it repeats, rounded up to a
multiple of this many positions (so that few widths compile), and at most by an eighth of the row (rounded up
likewise): the attention's cost grows with that layout's padding, a run of its own (cuDNN's packed layout computes it
as one more sequence), so rows are planned to fill it too (a 1B update on an H200 with the layout as wide as the
widest row's prompts needed, 12,032 positions for rows of 8,448: 5.6% slower than without shared prompts,
benchmarks/RESULTS.md)."""


def pack(input_ids: np.ndarray, attention_mask: np.ndarray, completion_mask: np.ndarray, *,
         rows_multiple: int | None, least_rows: int = 1, share_prompts: bool = False) -> PackedRows:
    """The padded rows ``input_ids`` / ``attention_mask`` [N, Lp + T] (left-padded prompts, right-padded completions of
    ``T`` = ``completion_mask.shape[1]`` columns) packed into rows of the same width (padding: token 0);
    the row count padded with empty rows to a multiple of ``rows_multiple`` (None: a power of two, at least
    ``least_rows``, e.g. the batch's shards on a mesh) and the sequences per row to a power of two, so that few
    shapes compile. ``share_prompts``: the sequences of one prompt (a GRPO group) in a packed row hold all but its
    last token once (the module docstring)."""
    input_ids = np.asarray(input_ids)
    n, width = input_ids.shape
    t = np.asarray(completion_mask).shape[1]
    prompt_width = width - t
    first, lengths = sequence_extents(attention_mask, completion_mask)
    # Completion token j sits at padded column prompt_width + j and is predicted by the column before it, which is in
    # the sequence from j0 on (j0 = 1 only for a row without a prompt token): tokens j0 .. j0 + scored - 1 are scored.
    j0 = np.maximum(first + 1 - prompt_width, 0)
    scored = np.maximum(lengths - (prompt_width - first) - j0, 0)
    if share_prompts:
        # The prefix a row shares: its prompt but the last token, whose column predicts the row's own first token.
        prefix = np.maximum(prompt_width - first - 1, 0)
        limits = np.array([width, t, width + _round_up(width // 8, EXPANDED_BUCKET)])
        plan = _plan_shared(input_ids, first, prefix, lengths, scored, limits)
        # The attention's layout: every row's sequences whole, and at least one position of padding after them (the
        # packed row's padding columns take its output).
        expanded = _round_up(max(int(lengths[[i for u in units for i in u]].sum()) for units in plan) + 1,
                             EXPANDED_BUCKET)
    else:
        prefix = np.zeros(n, np.int64)
        plan = [[[i] for i in row] for row in plan_rows(np.stack([lengths, scored], axis=1), [width, t])]
        expanded = width
    r = (1 << (max(len(plan), least_rows) - 1).bit_length() if rows_multiple is None
         else _round_up(len(plan), rows_multiple))
    s = 1 << (max(sum(map(len, units)) for units in plan) - 1).bit_length()
    ids = np.zeros((r, width), np.int32)
    segments = np.ones((r, expanded), np.int32)  # rows past the plan: one segment of padding
    if share_prompts:
        positions = np.zeros((r, width), np.int32)
        expand = np.full((r, expanded), width - 1, np.int32)
        repeats = max(len(unit) for units in plan for unit in units)
        copies = np.full((r, width, 1 << (repeats - 1).bit_length()), expanded, np.int32)
        copies[:, :, 0] = expanded - 1
    columns = np.zeros((r, t), np.int32)
    targets = np.zeros((r, t), np.int32)
    gather = np.zeros((r, s, t), np.int32)
    sequence = np.full((r, s), -1, np.int32)
    for row, units in enumerate(plan):
        at = e = done = slot = 0  # compact column, expanded column, scored column, sequence slot
        for unit in units:
            pl, head = int(prefix[unit[0]]), at  # the unit's shared prefix sits at head .. head + pl
            if pl:
                ids[row, at:at + pl] = input_ids[unit[0], first[unit[0]]:first[unit[0]] + pl]
                positions[row, at:at + pl] = np.arange(pl)
                at += pl
            for repeat, i in enumerate(unit):
                size, k, j = int(lengths[i]) - pl, int(scored[i]), int(j0[i])
                ids[row, at:at + size] = input_ids[i, first[i] + pl:first[i] + pl + size]
                segments[row, e:e + pl + size] = slot + 1
                if share_prompts:
                    positions[row, at:at + size] = np.arange(pl, pl + size)
                    expand[row, e:e + pl + size] = np.concatenate([np.arange(head, head + pl),
                                                                   np.arange(at, at + size)])
                    copies[row, head:head + pl, repeat] = np.arange(e, e + pl)
                    copies[row, at:at + size, 0] = np.arange(e + pl, e + pl + size)
                start = at + prompt_width + j - 1 - first[i] - pl  # the column predicting completion token j
                columns[row, done:done + k] = np.arange(start, start + k)
                targets[row, done:done + k] = input_ids[i, prompt_width + j:prompt_width + j + k]
                gather[row, slot, j:j + k] = np.arange(done, done + k)
                sequence[row, slot] = i
                at, e, done, slot = at + size, e + pl + size, done + k, slot + 1
        segments[row, e:] = slot + 1
    if not share_prompts:  # the expanded layout is the packed row itself
        return PackedRows(ids, segments, columns, targets, gather, sequence)
    return PackedRows(ids, segments, columns, targets, gather, sequence, positions, expand, copies)


def _plan_shared(input_ids: np.ndarray, first: np.ndarray, prefix: np.ndarray, lengths: np.ndarray,
                 scored: np.ndarray, limits: np.ndarray) -> list[list[list[int]]]:
    """The units of each packed row with shared prompts (a unit: rows of one prefix, laid out after one copy of it).
    Rows are placed prefix by prefix (most tokens first), longest first, each into the first packed row that holds
    its prefix already and has room for its own tokens, else into the first with room for it whole; ``limits`` bound
    a packed row's tokens, scored columns and tokens in the attention's layout (its rows whole). A row without a
    prefix is a unit of its own. (Longest first over every row, as :func:`first_fit`, scatters a group over rows
    where its prefix is not: on a long-tailed 1B step 80 packed rows instead of 76.)"""
    groups: dict[bytes | int, list[int]] = {}
    for i in np.argsort(-lengths, kind="stable").tolist():
        groups.setdefault(input_ids[i, first[i]:first[i] + prefix[i]].tobytes() if prefix[i] else i, []).append(i)
    plan: list[dict] = []  # per packed row: prefix -> its unit
    room = _Room(limits)
    for key, i in [(key, i) for key, rows in sorted(groups.items(), key=lambda kv: -int(lengths[kv[1]].sum()))
                   for i in rows]:
        whole = np.array([lengths[i], scored[i], lengths[i]])
        need = whole - np.array([prefix[i], 0, 0])  # into a packed row that holds its prefix already
        r = room.first(need, np.array([key in units for units in plan], bool))
        if r is None:
            r, need = room.first(whole), whole
        r = room.take(r, need, "tokens, scored columns, attended tokens")
        if r == len(plan):
            plan.append({})
        plan[r].setdefault(key, []).append(i)
    return [list(units.values()) for units in plan]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def per_sequence(values: np.ndarray | None, sequence: np.ndarray, fill) -> np.ndarray | None:
    """A padded-batch per-row array ``values`` [N, ...] laid out per sequence slot [R, S, ...] (``fill`` in empty
    slots)."""
    if values is None:
        return None
    values = np.asarray(values)
    out = values[np.maximum(sequence, 0)]
    empty = (sequence < 0).reshape(sequence.shape + (1,) * (values.ndim - 1))
    return np.where(empty, np.asarray(fill, values.dtype), out)
