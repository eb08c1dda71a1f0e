"""Sequence packing (optim.packing): the packed rows hold every sequence once and point each completion token at the
position that predicts it; a packed update's loss and gradient are the padded update's (float32)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from train_testlib import grpo_learner, max_rel_err, random_step_batch, tiny_model

from jrl.losses import GRPOConfig
from jrl.train.config import OptimConfig
from jrl.train.packing import first_fit, pack, plan_rows, sequence_extents, thin_rows

ALGO = GRPOConfig(num_generations=2, loss_type="dapo", metrics="full")


def _long_tailed_batch(seed: int, n: int = 12, completion_len: int = 24):
    """A step whose completions are mostly short with a few long ones (what packing is for)."""
    batch = random_step_batch(seed=seed, n=n, prompt_len=6, completion_len=completion_len)
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.geometric(0.25, n), completion_len)
    lengths[0] = completion_len
    mask = (np.arange(completion_len)[None] < lengths[:, None]).astype(np.int32)
    p = batch.input_ids.shape[1] - completion_len
    ids = batch.input_ids.copy()
    ids[:, p:] = np.where(mask > 0, rng.integers(1, 50, (n, completion_len)), 0)
    attention = batch.attention_mask.copy()
    attention[:, p:] = mask
    samp = np.where(mask > 0, -rng.uniform(4.5, 6.5, mask.shape), np.nan).astype(np.float32)
    return batch._replace(input_ids=ids, attention_mask=attention, completion_ids=ids[:, p:], completion_mask=mask,
                          truncated=lengths == completion_len, sampler_logprobs=samp, has_signal=np.ones(n, bool))


def _grouped_batch(seed: int, group: int = 4, n: int = 12):
    """:func:`_long_tailed_batch` whose rows come in groups of ``group`` with one prompt (a GRPO step)."""
    batch = _long_tailed_batch(seed, n=n)
    p = batch.input_ids.shape[1] - batch.completion_ids.shape[1]
    lead = np.arange(n) // group * group
    ids, attention = batch.input_ids.copy(), batch.attention_mask.copy()
    ids[:, :p], attention[:, :p] = ids[lead, :p], attention[lead, :p]
    return batch._replace(input_ids=ids, attention_mask=attention)


def test_shared_prompts_lay_each_prompt_once_and_every_sequence_whole_for_the_attention():
    """With shared prompts a group's prompt (but its last token) sits once in a packed row; the attention's layout
    (``expand``) holds every sequence whole with the positions of its padded row, each packed column takes the output
    of a position that reads it, and the scored columns predict the completion tokens."""
    batch = _grouped_batch(seed=7)
    t = batch.completion_ids.shape[1]
    plain = pack(batch.input_ids, batch.attention_mask, batch.completion_mask, rows_multiple=1)
    rows = pack(batch.input_ids, batch.attention_mask, batch.completion_mask, rows_multiple=1, share_prompts=True)
    first, lengths = sequence_extents(batch.attention_mask, batch.completion_mask)
    prompts = batch.input_ids.shape[1] - t - first
    assert sorted(rows.sequence[rows.sequence >= 0].tolist()) == list(range(len(first)))
    assert rows.segment_ids.shape[1] > rows.input_ids.shape[1] == plain.input_ids.shape[1]
    layout = rows.segment_ids.shape[1]
    for r in range(rows.input_ids.shape[0]):
        real = np.flatnonzero(rows.segment_ids[r] <= (rows.sequence[r] >= 0).sum())
        tokens = np.unique(rows.expand[r, real])
        for c in tokens:  # each column's copies: the positions reading it, in order (its output's first)
            held = rows.copies[r, c]
            np.testing.assert_array_equal(held[held < layout], real[rows.expand[r, real] == c])
        for s, i in enumerate(rows.sequence[r]):
            if i < 0:
                continue
            inside = rows.segment_ids[r] == s + 1
            at = rows.expand[r, inside]
            np.testing.assert_array_equal(rows.input_ids[r, at], batch.input_ids[i, first[i]:first[i] + lengths[i]])
            np.testing.assert_array_equal(rows.positions[r, at], np.arange(lengths[i]))
            loss = batch.completion_mask[i] > 0
            column = rows.scored[r, rows.gather[r, s, loss]]
            np.testing.assert_array_equal(rows.targets[r, rows.gather[r, s, loss]], batch.completion_ids[i, loss])
            assert set(column.tolist()) <= set(at.tolist())  # a column of this sequence's own tokens
            np.testing.assert_array_equal(rows.positions[r, column] + 1,
                                          _first_completion_position(batch, i) + np.flatnonzero(loss))
    # Every packed token is read by the attention's layout, a prompt's by each sequence of its unit and nothing else
    # twice: the packed rows hold the sequences' tokens less the repeated prompts.
    packed = repeated = 0
    for r in range(rows.input_ids.shape[0]):
        real = rows.segment_ids[r] <= (rows.sequence[r] >= 0).sum()
        packed += len(np.unique(rows.expand[r, real]))
        prefixes = {}
        for s, i in enumerate(rows.sequence[r]):
            if i >= 0 and prompts[i] > 1:
                head = rows.expand[r, rows.segment_ids[r] == s + 1][:prompts[i] - 1]
                prefixes.setdefault(head.tobytes(), []).append(len(head))
        repeated += sum(sizes[0] * (len(sizes) - 1) for sizes in prefixes.values())
    assert repeated > 0 and packed == lengths.sum() - repeated


def _first_completion_position(batch, i: int) -> int:
    """The position of row ``i``'s first completion token in its padded row (its real prompt tokens before it)."""
    t = batch.completion_ids.shape[1]
    return int(batch.attention_mask[i, :batch.input_ids.shape[1] - t].sum())


def test_packed_rows_hold_every_sequence_once_and_point_at_its_tokens():
    batch = _long_tailed_batch(seed=1)
    n, width = batch.input_ids.shape
    t = batch.completion_ids.shape[1]
    rows = pack(batch.input_ids, batch.attention_mask, batch.completion_mask, rows_multiple=4)
    assert rows.input_ids.shape[0] % 4 == 0 and rows.input_ids.shape[0] < n  # fewer rows than padded
    assert sorted(rows.sequence[rows.sequence >= 0].tolist()) == list(range(n))
    first, lengths = sequence_extents(batch.attention_mask, batch.completion_mask)
    for r in range(rows.input_ids.shape[0]):
        for s, i in enumerate(rows.sequence[r]):
            if i < 0:
                continue
            inside = rows.segment_ids[r] == s + 1
            assert inside.sum() == lengths[i]
            np.testing.assert_array_equal(rows.input_ids[r, inside], batch.input_ids[i, first[i]:first[i] + lengths[i]])
            loss = batch.completion_mask[i] > 0
            at = rows.gather[r, s, loss]  # the scored column predicting each loss token: its target is that token
            np.testing.assert_array_equal(rows.targets[r, at], batch.completion_ids[i, loss])
            column = rows.scored[r, at]
            assert (rows.segment_ids[r, column] == s + 1).all() and (rows.segment_ids[r, column + 1] == s + 1).all()
            np.testing.assert_array_equal(rows.input_ids[r, column + 1], batch.completion_ids[i, loss])
    assert rows.gather.shape[1] & (rows.gather.shape[1] - 1) == 0 and rows.gather.shape[2] == t
    padding = sum(width - int(sum(lengths[i] for i in row if i >= 0)) for row in rows.sequence)
    assert padding < (batch.attention_mask == 0).sum()  # less padding than the padded rows
    assert (rows.segment_ids > 0).all()  # the padding is a segment of its own: every query attends to something
    # The packed forward promises the attention at most S + 1 runs per row (cuDNN's packed layout needs the bound).
    runs = 1 + (np.diff(rows.segment_ids, axis=1) != 0).sum(axis=1)
    assert runs.max() <= rows.gather.shape[1] + 1 and runs.max() > 2
    assert max(sum(lengths[plan]) for plan in plan_rows(lengths, [width])) <= width
    assert plan_rows([[5, 4]] * 3, [20, 8]) == [[0, 1], [2]]  # the scored budget binds before the width
    with pytest.raises(ValueError, match=r"a sequence of \[21, 4\] \(tokens, scored columns...\) does not fit a packed "
                                         r"row of \[20, 8\]"):
        plan_rows([[5, 4], [21, 4]], [20, 8])
    # The LM head runs over at most T scored columns per row, each a distinct column of the row.
    assert rows.scored.shape == (rows.input_ids.shape[0], t)
    for r in range(rows.input_ids.shape[0]):
        used = rows.gather[r][batch.completion_mask[np.maximum(rows.sequence[r], 0)] * (rows.sequence[r] >= 0)[:, None] > 0]
        assert len(set(rows.scored[r, used].tolist())) == len(used)
    whole = pack(batch.input_ids, batch.attention_mask, batch.completion_mask, rows_multiple=None)
    shards = pack(batch.input_ids, batch.attention_mask, batch.completion_mask, rows_multiple=None, least_rows=16)
    assert whole.input_ids.shape[0] & (whole.input_ids.shape[0] - 1) == 0 and shards.input_ids.shape[0] == 16


def _rows_hold(plan: list[list[int]], sizes: np.ndarray, limits) -> bool:
    """Every sequence in exactly one row, every row within its token and scored-column budgets."""
    return (sorted(i for row in plan for i in row) == list(range(len(sizes)))
            and all((sizes[row].sum(axis=0) <= limits).all() for row in plan))


def test_crowded_rows_are_thinned_by_moves_and_swaps_without_another_row():
    # Two rows of two 45-token sequences (10 tokens free each), one of ten 10-token ones; (tokens, scored columns).
    sizes, plan = np.array([[45, 14]] * 4 + [[10, 3]] * 10), [[0, 1], [2, 3], list(range(4, 14))]
    moved = thin_rows(plan, sizes, np.array([100, 40]))
    assert _rows_hold(moved, sizes, [100, 40]) and len(moved) == 3
    assert sorted(map(len, moved)) == [3, 3, 8]  # two 10s moved; 4 per row cannot hold 14 sequences in 3 rows
    # The scored budget binds as the tokens do: 2 scored columns free in the first rows take no 10 (3 scored).
    assert sorted(map(len, thin_rows(plan, sizes, np.array([100, 30])))) == [2, 2, 10]
    sizes = np.array([[20, 0]] * 5 + [[10, 0]] * 10)  # both rows full: only two 10s for one 20 thins the second
    swapped = thin_rows([list(range(5)), list(range(5, 15))], sizes, np.array([100, 0]))
    assert _rows_hold(swapped, sizes, [100, 0]) and sorted(map(len, swapped)) == [7, 8]
    # A long-tailed step: first fit crowds its shortest sequences into its last rows; thinned, the bound on
    # sequences per row (what the packed attention costs by) halves, with as many rows.
    rng = np.random.default_rng(0)
    completions = np.minimum(rng.geometric(1 / 1024, 512), 8192)
    lengths, width, t = completions + 256, 256 + int(completions.max()), int(completions.max())
    sizes = np.stack([lengths, completions], axis=1)
    crowded, plan = first_fit(sizes, np.array([width, t])), plan_rows(sizes, [width, t])
    assert _rows_hold(plan, sizes, [width, t]) and len(plan) == len(crowded)
    assert max(map(len, crowded)) > 16 and max(map(len, plan)) <= 16


LOSSES = {"dapo": ("dapo", 2, {}), "grpo": ("grpo", None, {}), "dr_grpo": ("dr_grpo", 2, {}),
          "gspo+kl": ("grpo", 2, dict(importance_sampling_level="sequence", beta=0.05))}


@pytest.mark.parametrize("loss,loss_head,share", [
    *((loss, head, False) for head in ("logprobs", "fused") for loss in LOSSES),
    ("dapo", "fused", True), ("gspo+kl", "logprobs", True),
])
def test_a_packed_update_is_the_padded_update(loss, loss_head, share):
    """Packed rows through the log-prob kernel or the loss-fused head, and rows holding each group's prompt once
    (``share``), give the padded rows' loss, gradient and update (the padded side through the log-prob kernel;
    float32)."""
    loss_type, mb, extra = LOSSES[loss]
    algo = dataclasses.replace(ALGO, loss_type=loss_type, num_generations=4 if share else 2, **extra)
    batch = _grouped_batch(seed=8) if share else _long_tailed_batch(seed=3)
    if algo.beta:
        batch = batch._replace(ref_logprobs=np.where(batch.completion_mask > 0, -2.5, 0.0).astype(np.float32))
    padded, u1 = grpo_learner(tiny_model(seed=4), algo, OptimConfig(micro_batch_size=mb), total_updates=2,
                              temperature=0.7, loss_head="logprobs")
    packed, u2 = grpo_learner(tiny_model(seed=4), algo,
                              OptimConfig(micro_batch_size=mb, packing=True, share_prompts=share),
                              total_updates=2, temperature=0.7, loss_head=loss_head)
    (term,) = u2.policy_terms(packed, batch)
    assert term.rows.input_ids.shape[0] < batch.input_ids.shape[0]
    assert term.loss.loss.fused_head == (loss_head == "fused")
    assert (term.rows.expand is not None) == share  # shared prompts: the attention runs over a wider layout
    assert (term.rows.segment_ids.shape[1] > term.rows.input_ids.shape[1]) == share
    g1, c1, _ = padded.accumulate(u1.policy_terms(padded, batch))
    g2, c2, _ = packed.accumulate([term])
    assert np.isfinite(float(sum(c1["loss"]))) and float(abs(sum(c1["loss"]))) > 0
    assert float(sum(c2["loss"])) == pytest.approx(float(sum(c1["loss"])), rel=1e-5)
    assert max_rel_err(g2, g1) <= 1e-5
    m1, m2 = u1(padded, batch), u2(packed, batch)
    assert max_rel_err(packed.params, padded.params) <= 1e-5
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5)
    assert m2["num_tokens"] == m1["num_tokens"] == float(batch.completion_mask.sum())


def test_an_moe_update_with_shared_prompts_is_the_padded_update():
    """An MoE model (router statistics over each packed token once, through the gathered layout's segments) with
    shared prompts: the padded rows' loss and gradient (float32, no balance loss)."""
    moe = dict(model_type="qwen3_moe", qk_norm=True, head_dim=8, num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=16)
    algo, batch = dataclasses.replace(ALGO, num_generations=4), _grouped_batch(seed=9)
    padded, u1 = grpo_learner(tiny_model(seed=4, **moe), algo, OptimConfig(micro_batch_size=2), total_updates=2,
                              loss_head="logprobs")
    shared, u2 = grpo_learner(tiny_model(seed=4, **moe), algo,
                              OptimConfig(micro_batch_size=2, packing=True, share_prompts=True), total_updates=2)
    (term,) = u2.policy_terms(shared, batch)
    g1, c1, _ = padded.accumulate(u1.policy_terms(padded, batch))
    g2, c2, _ = shared.accumulate([term])
    assert term.rows.expand is not None and float(abs(sum(c1["loss"]))) > 0
    assert float(sum(c2["loss"])) == pytest.approx(float(sum(c1["loss"])), rel=1e-5)
    assert max_rel_err(g2, g1) <= 1e-5


def test_old_and_reference_logprobs_of_packed_rows_are_the_padded_ones():
    """Two updates per batch (old log-probs) and a KL term (reference log-probs of the initial weights): filled in
    from packed rows they equal the padded rows' on every loss token, and the two passes give the padded update."""
    algo = dataclasses.replace(ALGO, beta=0.04)
    batch = _long_tailed_batch(seed=5)
    padded, u1 = grpo_learner(tiny_model(seed=6), algo, OptimConfig(micro_batch_size=4), total_updates=4,
                              num_iterations=2, temperature=0.7)
    packed, u2 = grpo_learner(tiny_model(seed=6), algo, OptimConfig(micro_batch_size=4, packing=True),
                              total_updates=4, num_iterations=2, temperature=0.7)
    b1, b2 = u1.prepare(padded, batch), u2.prepare(packed, batch)
    loss = batch.completion_mask > 0
    for name in ("old_logprobs", "ref_logprobs"):
        want, got = getattr(b1, name)[loss], getattr(b2, name)[loss]
        assert np.isfinite(got).all() and np.abs(want).max() > 0
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
    m1, m2 = u1(padded, batch), u2(packed, batch)
    assert max_rel_err(packed.params, padded.params) <= 1e-5
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5)


def test_packing_refuses_length_buckets_and_leaves_bnpo_padded():
    with pytest.raises(ValueError, match=r"OptimConfig\.packing=True.*length_bucket=0"):
        OptimConfig(packing=True, length_bucket=4)
    with pytest.raises(ValueError, match=r"OptimConfig\.share_prompts=True.*set packing=True"):
        OptimConfig(share_prompts=True)
    learner, update = grpo_learner(tiny_model(seed=4), dataclasses.replace(ALGO, loss_type="bnpo"),
                                   OptimConfig(micro_batch_size=2, packing=True), total_updates=1)
    batch = _long_tailed_batch(seed=2)
    assert [t.rows.input_ids.shape for t in update.policy_terms(learner, batch)] == [batch.input_ids.shape]


def test_an_update_from_a_plan_made_ahead_is_the_update():
    """``PolicyUpdate.plan`` (the packed rows and loss terms, made while the devices train on something else) then
    ``start`` from it: the same update and metrics as the update in one call; no plan where the update needs
    log-probs from the devices first (a KL term without reference log-probs, several updates per batch)."""
    batch = _grouped_batch(seed=8)
    algo = dataclasses.replace(ALGO, num_generations=4)
    optim = OptimConfig(micro_batch_size=2, packing=True, share_prompts=True)
    whole, u1 = grpo_learner(tiny_model(seed=4), algo, optim, total_updates=2)
    ahead, u2 = grpo_learner(tiny_model(seed=4), algo, optim, total_updates=2)
    plan = u2.plan(ahead, batch)
    assert plan is not None and plan[0][0].rows.expand is not None
    m1, m2 = u1(whole, batch), u2.start(ahead, batch, terms=plan)()
    assert max_rel_err(ahead.params, whole.params) == 0.0 and m1 == m2
    for changed, iterations in ((dict(beta=0.05), 1), ({}, 2)):
        learner, update = grpo_learner(tiny_model(seed=4), dataclasses.replace(algo, **changed), optim,
                                       total_updates=2, num_iterations=iterations)
        assert update.plan(learner, batch) is None
