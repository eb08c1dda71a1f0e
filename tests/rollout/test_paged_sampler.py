"""The paged sampler (``rollout.kv.layout = "paged"``): sampled log-probs equal a full forward over the same
tokens (prompts ending inside a page, on a page boundary, one token long; rows decoded in fewer slots than rows; a
pool small enough to preempt), near-greedy tokens equal the dense sampler's and greedy decoding by full forwards,
a row's tokens do not depend on the slots, the pool or the page size, and the scheduler keeps every page in exactly
one place."""

from __future__ import annotations

import dataclasses
import logging

import jax
import numpy as np
import pytest
from rollout_testlib import (PAD, continue_from_kept, full_forward_logprobs, greedy_by_full_forward, random_prompts,
                             tiny_model)

from jrl.rollout import SamplingParams
from jrl.rollout.jax_engine import JaxRolloutEngine
from jrl.rollout.kv_config import KVCacheConfig
from jrl.rollout.paged import (POOL_FREE_FRACTION, SCRATCH_PAGE, PageScheduler, RowGroup, device_parts, generate_paged,
                               new_groups,
                               pages_for, pool_pages)
from jrl.rollout.jax_engine import row_bucket
from flax import nnx

LENGTHS = [1, 8, 13, 17, 5]
STOPS = (5, 9, 17)


def _paged(model, prompts, params, kv, *, g=3, seed=7):
    graphdef, state = nnx.split(model)
    return generate_paged(graphdef, [state], new_groups(prompts, g), params, seed=seed, kv=kv, pad_id=PAD,
                          prompt_bucket=8, slot_bucket=row_bucket)


def _batch(model, prompts, params, kv, g=3, seed=7):
    return JaxRolloutEngine(model, pad_id=PAD, prompt_bucket=8, kv=kv).generate(prompts, params, num_generations=g,
                                                                              seed=seed)


@pytest.mark.parametrize("kind", ["llama", "moe", "qwen2_bias", "mixtral_sliding"])
def test_paged_logprobs_match_a_full_forward_with_few_slots_and_preemption(kind, caplog):
    model = tiny_model(kind, seed=3)
    prompts = random_prompts(np.random.default_rng(2), LENGTHS)
    params = SamplingParams(max_new_tokens=30, temperature=0.7, stop_token_ids=STOPS)
    kv = KVCacheConfig(layout="paged", page_size=8, round_steps=8, slots=6, pages=16)
    out = _paged(model, prompts, params, kv)
    assert out["preempted"] > 0 and out["pool"] == 16
    with caplog.at_level(logging.WARNING, logger="jrl.rollout.jax_engine"):
        batch = _batch(model, prompts, params, kv)
    assert f"{out['preempted']} rows gave their pages back" in caplog.text and "rollout.kv.slots lower" in caplog.text
    assert np.array_equal(batch.completion_ids, out["tokens"])
    mask = batch.completion_mask.astype(bool)
    assert mask.any() and (~mask).any() and batch.truncated.any() and (~batch.truncated).any()
    reference = full_forward_logprobs(model, batch, 0.7)
    assert np.isfinite(batch.sampling_logprobs).all() and (batch.sampling_logprobs[mask] < 0).all()
    assert np.abs(batch.sampling_logprobs - reference)[mask].max() <= 1e-4
    assert (batch.sampling_logprobs[~mask] == 0).all() and (batch.completion_ids[~mask] == PAD).all()


def test_near_greedy_paged_tokens_equal_the_dense_sampler_and_full_forward_greedy():
    model = tiny_model("llama", seed=4)
    prompts = random_prompts(np.random.default_rng(3), LENGTHS)
    params = SamplingParams(max_new_tokens=20, temperature=1e-6, stop_token_ids=STOPS)
    dense = _batch(model, prompts, params, KVCacheConfig())
    paged = _batch(model, prompts, params, KVCacheConfig(layout="paged", page_size=8, round_steps=8, slots=4))
    assert np.array_equal(paged.completion_ids, dense.completion_ids)
    assert np.array_equal(paged.completion_mask, dense.completion_mask)
    assert np.array_equal(paged.truncated, dense.truncated) and np.array_equal(paged.prompt_ids, dense.prompt_ids)
    greedy = greedy_by_full_forward(model, prompts, 20, STOPS)
    for r in range(len(paged.completion_ids)):
        n = int(paged.completion_mask[r].sum())
        assert paged.completion_ids[r, :n].tolist() == greedy[r // 3]


def test_prefilling_a_few_sequences_at_a_time_gives_the_same_rows():
    """The prompts (and a partial rollout's carried rows) are prefilled at most ``prefill_tokens`` tokens per call:
    one sequence per call gives the rows of one call for all."""
    model = tiny_model("llama", seed=5)
    prompts = random_prompts(np.random.default_rng(9), LENGTHS)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=STOPS)
    graphdef, state = nnx.split(model)
    groups = new_groups(prompts, 2) + [RowGroup(prompts[0], [[3, 4, 5], [6]], [10, 11])]

    def run(tokens):
        return generate_paged(graphdef, [state], groups, params, seed=1, kv=KVCacheConfig(layout="paged", page_size=8, round_steps=8),
                              pad_id=PAD, prompt_bucket=8, slot_bucket=row_bucket, prefill_tokens=tokens)

    whole, one = run(1 << 20), run(1)
    assert np.array_equal(whole["tokens"], one["tokens"]) and np.array_equal(whole["mask"], one["mask"])
    np.testing.assert_allclose(one["logprobs"], whole["logprobs"], atol=1e-5)


def test_a_rows_tokens_do_not_depend_on_slots_pool_page_size_or_round_length():
    model = tiny_model("llama", seed=5)
    prompts = random_prompts(np.random.default_rng(4), LENGTHS)
    params = SamplingParams(max_new_tokens=24, temperature=1.0, stop_token_ids=STOPS)
    runs = [_paged(model, prompts, params, kv) for kv in (
        KVCacheConfig(layout="paged"), KVCacheConfig(layout="paged", page_size=8, round_steps=8, slots=2),
        KVCacheConfig(layout="paged", page_size=16, round_steps=16, slots=5, pages=12),
        KVCacheConfig(layout="paged", page_size=8, round_steps=8, slots=16, pages=14),
        KVCacheConfig(layout="paged", page_size=8, slots=2, round_steps=5),
        KVCacheConfig(layout="paged", page_size=8, slots=16, pages=16, round_steps=13),
        KVCacheConfig(layout="paged", page_size=8, round_steps=4, tail_slots=1),
        KVCacheConfig(layout="paged", page_size=8, round_steps=2, slots=8, tail_slots=2))]
    assert runs[0]["preempted"] == 0 and runs[2]["preempted"] + runs[3]["preempted"] > 0
    assert runs[0]["shrinks"] == 0 and runs[6]["shrinks"] >= 3 and runs[7]["shrinks"] >= 1
    assert runs[4]["rounds"] > runs[1]["rounds"]  # rounds of 5 steps instead of 8: more of them
    lengths = runs[0]["mask"].sum(1)
    assert len(set(lengths.tolist())) > 3  # ragged
    for run in runs[1:]:
        assert np.array_equal(run["tokens"], runs[0]["tokens"]) and np.array_equal(run["mask"], runs[0]["mask"])
        assert np.abs(run["logprobs"] - runs[0]["logprobs"]).max() <= 1e-5
    other_seed = _paged(model, prompts, params, KVCacheConfig(layout="paged"), seed=8)
    assert not np.array_equal(other_seed["tokens"], runs[0]["tokens"])


def test_finer_slot_buckets_decode_the_same_rows_in_fewer_slots(monkeypatch):
    """``rollout.kv.slot_buckets`` 4: 304 rows decode in 320 slots instead of 512, the tail shrinks through the finer
    counts too (224, 160), and every row samples what it does in power-of-two slots (a partial rollout's slot hint, the
    most rows a step can have, gives way to the rows)."""
    from jrl.rollout import paged

    assert [paged.decode_slots(n, 4) for n in (1, 100, 128, 129, 136, 513, 608, 1024)] == \
        [1, 128, 128, 160, 160, 640, 640, 1024]
    assert [paged.decode_slots(n, 2) for n in (129, 200, 608)] == [192, 256, 768]
    assert [paged.decode_slots(n, 8) for n in (129, 145, 513, 577, 608)] == [144, 160, 576, 640, 640]
    assert [paged.decode_slots(n, 1) for n in (129, 608)] == [256, 1024]
    assert KVCacheConfig().slot_buckets == 8
    with pytest.raises(ValueError, match=r"KVCacheConfig\.slot_buckets=3.*1 \(powers of two\), 2, 4 or 8"):
        KVCacheConfig(layout="paged", slot_buckets=3)
    slots_per_round = []
    real = paged._decode_round
    monkeypatch.setattr(paged, "_decode_round", lambda *a, **k: slots_per_round.append(a[7].shape[0]) or real(*a, **k))
    model = tiny_model("llama", seed=5)
    prompts = random_prompts(np.random.default_rng(6), np.random.default_rng(7).integers(2, 13, 38))
    params = SamplingParams(max_new_tokens=40, temperature=1.0, stop_token_ids=STOPS)
    graphdef, state = nnx.split(model)
    runs = {}
    for buckets in (1, 4):
        kv = KVCacheConfig(layout="paged", page_size=8, round_steps=4, tail_slots=16, slot_buckets=buckets)
        slots_per_round.clear()
        runs[buckets] = generate_paged(graphdef, [state], new_groups(prompts, 8), params, seed=7, kv=kv, pad_id=PAD,
                                       prompt_bucket=8, slot_bucket=row_bucket, slots=512)
        runs[buckets]["slots"] = list(slots_per_round)
    coarse, fine = runs[1], runs[4]
    assert coarse["slots"][0] == 512 and fine["slots"][0] == 320  # the hint holds powers of two, not finer buckets
    assert {224, 160} <= set(fine["slots"]) and all(n & (n - 1) == 0 for n in coarse["slots"])
    assert fine["shrinks"] > coarse["shrinks"] and fine["slot_steps"] < 0.8 * coarse["slot_steps"]
    assert len(set(fine["mask"].sum(1).tolist())) > 3
    np.testing.assert_array_equal(fine["tokens"], coarse["tokens"])
    np.testing.assert_array_equal(fine["mask"], coarse["mask"])
    assert np.abs(fine["logprobs"] - coarse["logprobs"]).max() <= 1e-5


def test_groups_go_to_their_home_device_and_the_others_even_out_the_rows():
    rng = np.random.default_rng(3)
    for count, devices in ((6, 3), (16, 8), (2, 4), (0, 2), (7, 3)):
        plain = [RowGroup([1], [[]] * 4, [i]) for i in range(count)]
        got = [part for part in device_parts(plain, devices) if len(part)]
        assert np.array_equal(np.concatenate(got or [np.zeros(0)]), np.arange(count))  # contiguous, in order
        if count and count % devices == 0:
            assert [p.tolist() for p in got] == [p.tolist() for p in np.array_split(np.arange(count), devices)]
        assert max(map(len, got), default=0) - min(map(len, got), default=0) <= 1
    for _ in range(50):
        count, devices = int(rng.integers(1, 24)), int(rng.integers(1, 6))
        homes = [int(h) if h < devices else None for h in rng.integers(0, 2 * devices, count)]
        sizes = rng.integers(1, 9, count).tolist()  # carried groups hold few running rows, new ones all of theirs
        groups = [RowGroup([1], [[]] * n, list(range(n)), home=h) for n, h in zip(sizes, homes)]
        parts = device_parts(groups, devices)
        assert sorted(i for part in parts for i in part.tolist()) == list(range(count))  # each group once
        for at, part in enumerate(parts):
            assert all(homes[i] in (None, at) for i in part)
        free = [i for i in range(count) if homes[i] is None]
        at_of = {i: at for at, part in enumerate(parts) for i in part.tolist()}
        assert [at_of[i] for i in free] == sorted(at_of[i] for i in free)  # the homeless laid out in order
        homed = [sum(sizes[i] for i in part if homes[i] is not None) for part in parts]
        rows = [sum(sizes[i] for i in part) for part in parts]
        # The level that pouring the homeless rows over the homed ones reaches, found by bisection here.
        low, high = 0.0, float(sum(sizes))
        for _ in range(60):
            mid = (low + high) / 2
            low, high = (mid, high) if sum(max(mid - h, 0) for h in homed) < sum(sizes[i] for i in free) else (low, mid)
        for at in range(devices):
            if rows[at] > homed[at]:  # a position given homeless groups ends within one group of the level
                assert abs(rows[at] - max(low, homed[at])) <= max(sizes) + 1e-6, (sizes, homes, rows, low)
            else:  # one given none was at or above the level, or within one group below it
                assert homed[at] >= low - max(sizes) - 1e-6, (sizes, homes, rows, low)
    # The homed rows count: a position whose carried groups hold many rows takes fewer new groups.
    carried = [RowGroup([1], [[]] * 8, list(range(8)), home=0) for _ in range(2)]
    new = [RowGroup([1], [[]] * 8, list(range(8))) for _ in range(6)]
    parts = device_parts(carried + new, 2)
    assert [sum(len((carried + new)[i].prefixes) for i in part) for part in parts] == [32, 32]
    with pytest.raises(ValueError, match="home, device position 2"):
        device_parts([RowGroup([1], [[]], [0], home=2)], 2)


def test_the_scheduler_keeps_every_page_in_one_place():
    """Random stops drive the scheduler round after round: a page is free, a prompt's or one running row's, never
    two of them; the scratch page is nobody's; each running row's table holds its prompt's full pages and then its
    own, those of its next round among them; preemption takes
    the row admitted last; every row finishes; no row takes pages past the most slots it can fill."""
    rng = np.random.default_rng(0)
    page, steps, g, most_new = 4, 4, 2, 25
    lengths = [1, 4, 7, 9]
    pool = 18
    free = list(range(1, pool))
    prompt_pages = [[free.pop(0) for _ in range(pages_for(n, page))] for n in lengths]
    row_prompt = [r // g for r in range(len(lengths) * g)]
    row_slots = [lengths[p] + most_new for p in row_prompt]
    sched = PageScheduler(slots=3, free=free, prompt_pages=prompt_pages, prompt_lengths=lengths,
                          row_prompt=row_prompt, row_slots=row_slots, page_size=page, table_width=12)
    prompt_owned = {p for pages in prompt_pages for p in pages}
    finished, grown = set(), {}
    for _ in range(200):
        if len(finished) == len(lengths) * g:
            break
        if not sched.waiting and rng.random() < 0.5:  # the tail: running rows move into fewer slots
            rows = [(s.row, tuple(sched.page_table[i]), int(sched.lengths[i]))
                    for i, s in enumerate(sched.slots) if s is not None]
            keep = sched.shrink(max(len(rows), 1))
            assert len(sched.slots) == len(sched.page_table) == len(sched.lengths) == len(keep) == max(len(rows), 1)
            assert [(s.row, tuple(sched.page_table[i]), int(sched.lengths[i]))
                    for i, s in enumerate(sched.slots) if s is not None] == rows
            with pytest.raises(ValueError, match="running rows"):
                sched.shrink(len(rows) - 1) if rows else sched.shrink(-1)
        before = {s.row: s.admitted for s in sched.slots if s is not None}
        admitted, preempted = sched.schedule(steps)
        for row in preempted:
            grown.pop(row, None)
        running = [(i, s) for i, s in enumerate(sched.slots) if s is not None]
        assert running, "a round with nothing to run"
        owned = [p for _, s in running for p in s.own]
        assert len(owned) == len(set(owned)) and not set(owned) & set(sched.free) and not set(owned) & prompt_owned
        assert SCRATCH_PAGE not in owned and SCRATCH_PAGE not in sched.free
        assert len(owned) + len(sched.free) + len(prompt_owned) == pool - 1
        for i, s in running:
            reach = pages_for(min(int(sched.lengths[i]) + steps, row_slots[s.row]), page)
            table = sched.page_table[i][:reach]
            assert table.tolist() == sched._shared(row_prompt[s.row]) + s.own  # the prompt's full pages, then its own
            assert SCRATCH_PAGE not in table and len(sched._shared(row_prompt[s.row])) + len(s.own) == reach
        if preempted:  # the rows preempted were admitted after every row still running
            assert max(before[r] for r in preempted) > max(before.get(s.row, -1) for _, s in running)
        for i, s in running:  # each running row writes up to ``steps`` tokens, or stops
            n = int(rng.integers(1, steps + 1))
            sched.lengths[i] += n
            grown[s.row] = grown.get(s.row, 0) + n
            if rng.random() < 0.25 or grown[s.row] > most_new - steps:
                finished.add(sched.release(i))
    assert len(finished) == len(lengths) * g and sorted(sched.free) == free and sched.preempted > 0


def test_paged_errors_name_the_knob():
    model = tiny_model("llama", seed=3)
    prompts = random_prompts(np.random.default_rng(2), LENGTHS)
    params = SamplingParams(max_new_tokens=30, temperature=0.7)
    with pytest.raises(ValueError, match=r"rollout\.kv\.pages=8 cannot hold one whole row.*use rollout\.kv\.pages >= "):
        _paged(model, prompts, params, KVCacheConfig(layout="paged", page_size=8, pages=8))
    engine = JaxRolloutEngine(model, pad_id=PAD, kv=KVCacheConfig(layout="paged"))
    with pytest.raises(ValueError, match=r"keeps no decode sessions"):
        engine.start_session(prompts, params, num_generations=1, seed=0)
    with pytest.raises(ValueError, match=r"KVCacheConfig\.layout"):
        KVCacheConfig(layout="blocked")
    with pytest.raises(ValueError, match=r"KVCacheConfig\.dtype.*float8_e4m3fn"):
        KVCacheConfig(layout="paged", dtype="int4")


def test_a_float8_pool_holds_one_byte_per_value_and_samples_near_the_model(monkeypatch):
    """``rollout.kv.dtype = float8_e4m3fn``: the pool (every layer's keys and values) is float8, and the sampled
    log-probs stay near a full forward of the model over the same tokens (the keys and values it reads are rounded to
    3 mantissa bits: near, not equal, where a pool of the model's dtype agrees to 1e-4 above)."""
    from jrl.rollout import paged

    pools = []
    real = paged._empty_pool
    monkeypatch.setattr(paged, "_empty_pool", lambda *a, **k: pools.append(real(*a, **k)) or pools[-1])
    model = tiny_model("llama", seed=5)
    prompts = random_prompts(np.random.default_rng(4), LENGTHS)
    params = SamplingParams(max_new_tokens=20, temperature=0.7, stop_token_ids=STOPS)
    kv = KVCacheConfig(layout="paged", page_size=8, round_steps=8, slots=4, dtype="float8_e4m3fn")
    batch = _batch(model, prompts, params, kv)
    assert pools and {leaf.dtype.name for pool in pools for leaf in jax.tree.leaves(pool)} == {"float8_e4m3fn"}
    mask = batch.completion_mask.astype(bool)
    gap = np.abs(batch.sampling_logprobs - full_forward_logprobs(model, batch, 0.7))[mask]
    assert mask.sum() > 50 and np.isfinite(gap).all()
    assert 1e-3 < gap.mean() < 0.3 and gap.max() < 3.0, (gap.mean(), gap.max())


def test_the_gpu_decode_rounds_options_are_valid_and_decode_the_same_rows(monkeypatch):
    """The compile options of a decode round on a GPU (``paged.GPU_ROUND_OPTIONS``) are options this XLA knows (an
    unknown name fails the compile, here on the CPU as on a GPU) and change no row: rounds compiled with them decode
    the tokens and log-probs of the default program."""
    from jrl.rollout import paged

    model = tiny_model("llama", seed=3)
    prompts = random_prompts(np.random.default_rng(2), LENGTHS)
    params = SamplingParams(max_new_tokens=20, temperature=0.7, stop_token_ids=STOPS)
    kv = KVCacheConfig(layout="paged", page_size=8, round_steps=8, slots=6)
    default = _paged(model, prompts, params, kv)
    gpu_rounds = paged._round_program("gpu")
    calls = []
    monkeypatch.setattr(paged, "_decode_round", lambda *a, **k: calls.append(1) or gpu_rounds(*a, **k))
    with_options = _paged(model, prompts, params, kv)
    assert calls and gpu_rounds is not paged._round_program(jax.default_backend())
    assert default["mask"].sum() > 20
    for name in ("tokens", "mask", "logprobs"):
        np.testing.assert_array_equal(with_options[name], default[name])


def test_a_generation_compiles_its_decode_round_once_and_a_model_of_the_same_structure_reuses_it():
    """A generation's first decode round (its pool from the prefill) and its later ones (the pool from a round) call
    one compiled program, also for weights not committed to a device (a model just made); another model of the same
    config (other weights, another split) runs that program too: the structure is one shared static argument
    (:func:`jrl.models.static_graph.split_static`)."""
    from jrl.rollout import paged

    prompts = random_prompts(np.random.default_rng(2), LENGTHS)
    params = SamplingParams(max_new_tokens=12, temperature=0.7, stop_token_ids=STOPS)
    kv = KVCacheConfig(layout="paged", page_size=8, round_steps=4, slots=6, tail_slots=0)  # one slot count
    rounds = paged._round_program(jax.default_backend())
    before = rounds._cache_size()
    first = _paged(tiny_model("llama", seed=3, num_hidden_layers=3), prompts, params, kv)  # a structure of its own
    assert first["rounds"] > 1 and rounds._cache_size() == before + 1
    second = _paged(tiny_model("llama", seed=4, num_hidden_layers=3), prompts, params, kv)
    assert rounds._cache_size() == before + 1
    assert not np.array_equal(first["logprobs"], second["logprobs"])


def test_rounds_at_the_tail_floor_go_two_at_a_time_and_sample_the_same_rows(monkeypatch):
    """Once no row waits and the slots are as few as they get, a round is launched before the previous one is read
    back: the rows sample exactly what one round at a time samples, from one compiled program; a generation that
    stops at enough groups (a partial rollout) never runs ahead, so it stops where it did."""
    from jrl.rollout import paged

    events = []
    real_round, real_collect = paged._decode_round, paged._Generation.collect
    monkeypatch.setattr(paged, "_decode_round", lambda *a, **k: events.append("l") or real_round(*a, **k))
    monkeypatch.setattr(paged._Generation, "collect", lambda self, out: events.append("r") or real_collect(self, out))
    model = tiny_model("llama", seed=5)
    prompts = random_prompts(np.random.default_rng(6), np.random.default_rng(7).integers(2, 13, 12))
    params = SamplingParams(max_new_tokens=40, temperature=1.0, stop_token_ids=STOPS)
    graphdef, state = nnx.split(model)
    kv = KVCacheConfig(layout="paged", page_size=8, round_steps=4, slots=16, tail_slots=4)

    def run(**kw):
        events.clear()
        out = generate_paged(graphdef, [state], new_groups(prompts, 3), params, seed=7, kv=kv, pad_id=PAD,
                             prompt_bucket=8, slot_bucket=row_bucket, **kw)
        return out, "".join(events)  # l: a round launched, r: one read

    rounds = paged._round_program(jax.default_backend())
    ahead, order = run()
    compiled = rounds._cache_size()
    assert "llrr" in order and ahead["shrinks"] >= 1  # two rounds, then their two reads
    assert len(set(ahead["mask"].sum(1).tolist())) > 3
    partial, partial_order = run(groups_needed=6)
    assert "ll" not in partial_order and not partial["finished"].all()
    with monkeypatch.context() as m:
        m.setattr(paged._Generation, "_can_run_ahead", lambda self: False)
        one, one_order = run()
    assert "ll" not in one_order and rounds._cache_size() == compiled
    for name in ("tokens", "mask", "stopped"):
        np.testing.assert_array_equal(ahead[name], one[name])
    assert np.abs(ahead["logprobs"] - one["logprobs"]).max() <= 1e-6
    assert ahead["rounds"] >= one["rounds"]
    params = SamplingParams(max_new_tokens=40, temperature=1.0)  # every row runs to its last token: no round after it
    full, full_order = run()
    with monkeypatch.context() as m:
        m.setattr(paged._Generation, "_can_run_ahead", lambda self: False)
        assert full["rounds"] == run()[0]["rounds"]
    assert "llrr" in full_order and full_order.endswith("lr") and full["mask"].all()


def test_a_generation_stops_at_enough_groups_and_its_rows_continue_as_they_would_have():
    """``groups_needed``: the generation ends once that many groups are finished; a row continued later from the
    tokens it had (prefilled again with them, its key carried on) samples exactly the tokens and log-probs of the
    uninterrupted generation."""
    model = tiny_model("llama", seed=5)
    prompts = random_prompts(np.random.default_rng(6), LENGTHS)
    params = SamplingParams(max_new_tokens=24, temperature=1.0, stop_token_ids=STOPS)
    kv = KVCacheConfig(layout="paged", page_size=8, round_steps=8, slots=4)
    graphdef, state = nnx.split(model)

    def run(groups, needed=None):
        return generate_paged(graphdef, [state], groups, params, seed=7, kv=kv, pad_id=PAD, prompt_bucket=8,
                              slot_bucket=row_bucket, groups_needed=needed)

    whole = run(new_groups(prompts, 3))
    assert whole["finished"].all()
    part = run(new_groups(prompts, 3), needed=2)
    done = part["finished"].reshape(len(prompts), 3).all(axis=1)
    assert 2 <= done.sum() < len(prompts) and not part["finished"].all()
    started = [r for r in range(len(part["finished"])) if not part["finished"][r] and part["mask"][r].any()]
    assert started, "some unfinished rows should hold tokens"
    for r in range(len(part["finished"])):
        n = int(part["mask"][r].sum())
        assert part["tokens"][r, :n].tolist() == whole["tokens"][r, :n].tolist()
    rest = [r for r in range(len(part["finished"])) if not part["finished"][r]]
    groups = [RowGroup(prompts[r // 3], [part["tokens"][r, :int(part["mask"][r].sum())].tolist()], [r]) for r in rest]
    more = run(groups)
    for i, r in enumerate(rest):
        n, m = int(part["mask"][r].sum()), int(more["mask"][i].sum())
        assert part["tokens"][r, :n].tolist() + more["tokens"][i, :m].tolist() == (
            whole["tokens"][r, :int(whole["mask"][r].sum())].tolist())
        logprobs = np.concatenate([part["logprobs"][r, :n], more["logprobs"][i, :m]])
        np.testing.assert_allclose(logprobs, whole["logprobs"][r, :n + m], atol=1e-4)
        assert more["stopped"][i] == whole["stopped"][r]


def test_the_default_pool_fits_the_free_memory_and_a_set_one_is_kept():
    kv = KVCacheConfig(layout="paged", page_size=16)
    args = dict(slots=64, prompt_pages=40, prompt_bucket_pages=64, max_new_tokens=1024)
    whole = pool_pages(kv, **args)  # a device that does not tell its memory (CPU): every slot's longest row
    need = 1 + 64 + 64 * (1024 // 16 + 1)  # each slot: its completion and a partial prompt page
    assert need <= whole < 2 * need and whole & (whole - 1) == 0  # rounded up to a power of two
    assert pool_pages(kv, **args, page_bytes=1 << 20, free_bytes=int(need / POOL_FREE_FRACTION + 1) << 20) == need
    capped = pool_pages(kv, **args, page_bytes=1 << 20, free_bytes=2000 << 20)  # 2000 pages free
    assert capped <= POOL_FREE_FRACTION * 2000 < 2 * capped and capped & (capped - 1) == 0  # a power of two
    tiny = pool_pages(kv, **args, page_bytes=1 << 20, free_bytes=10 << 20)  # less than a row: one row all the same
    assert tiny == 1 + 64 + 1024 // 16 + 1
    assert pool_pages(dataclasses.replace(kv, pages=500), **args, page_bytes=1 << 20, free_bytes=10 << 20) == 500


def test_carried_rows_are_prefilled_in_their_own_width_and_continue_as_they_would_have(monkeypatch):
    """A partial rollout's carried row much longer than the prompts is prefilled in a width of its own (the prompts
    keep theirs, so one long row does not widen every prompt's prefill), and still continues exactly as the
    uninterrupted generation."""
    from jrl.rollout import paged

    model = tiny_model("llama", seed=5)
    prompts = random_prompts(np.random.default_rng(6), LENGTHS)
    params = SamplingParams(max_new_tokens=120, temperature=1.0, stop_token_ids=())
    kv = KVCacheConfig(layout="paged", page_size=8, round_steps=8, slots=4)
    graphdef, state = nnx.split(model)
    widths = []
    prefill = paged._prefill

    def recording(graphdef, state, cache, ids, mask, page_ids, *, page_size):
        widths.append(ids.shape)
        return prefill(graphdef, state, cache, ids, mask, page_ids, page_size=page_size)

    monkeypatch.setattr(paged, "_prefill", recording)

    def run(groups):
        return generate_paged(graphdef, [state], groups, params, seed=7, kv=kv, pad_id=PAD, prompt_bucket=8,
                              slot_bucket=row_bucket)

    whole = run(new_groups(prompts[:1], 1))  # row 0 of prompt 0: 120 tokens (no stop ids)
    assert int(whole["mask"][0].sum()) == 120
    carried = whole["tokens"][0, :100].tolist()  # 100 of them carried: prompt + prefix > 100 tokens
    widths.clear()
    more = run([RowGroup(prompts[0], [carried], [0])] + new_groups(prompts[1:], 2))
    assert sorted(w for _, w in widths) == [32, 128], widths  # the prompts at their 32, the carried row at 128
    assert more["tokens"][0, :20].tolist() == whole["tokens"][0, 100:120].tolist()
    np.testing.assert_allclose(more["logprobs"][0, :20], whole["logprobs"][0, 100:120], atol=1e-4)


def test_a_prefill_writes_its_sequences_pages_alone_through_distinct_page_ids(monkeypatch):
    """Every page id a prefill call writes is distinct (the padding past a sequence's end and the bucket's filler rows
    get ids past the pool, dropped): with repeated ids (a shared scratch page) XLA's GPU scatter was most of a
    partial rollout's prefill. The pool's other pages, the scratch page included, stay zero, and the program
    declares its ids distinct."""
    import jax

    from jrl.rollout import paged

    model = tiny_model("llama", seed=5)
    prompts = random_prompts(np.random.default_rng(9), LENGTHS)
    params = SamplingParams(max_new_tokens=48, temperature=1.0, stop_token_ids=STOPS)
    graphdef, state = nnx.split(model)
    calls = []
    prefill = paged._prefill

    def recording(graphdef, state, cache, ids, mask, page_ids, *, page_size):
        out = prefill(graphdef, state, cache, ids, mask, page_ids, page_size=page_size)
        calls.append((np.asarray(page_ids), np.asarray(mask), jax.device_get(out[0])))
        return out

    monkeypatch.setattr(paged, "_prefill", recording)
    groups = new_groups(prompts, 2) + [RowGroup(prompts[0], [[3, 4, 5], list(range(1, 41))], [10, 11])]
    out = generate_paged(graphdef, [state], groups, params, seed=1, kv=KVCacheConfig(layout="paged", page_size=8),
                         pad_id=PAD, prompt_bucket=8, slot_bucket=row_bucket)
    pool, prompt_pages = out["pool"], out["prompt_pages"]
    assert len(calls) >= 2  # the prompts' width and the long carried row's
    written = []
    for page_ids, mask, _ in calls:
        ids = page_ids.reshape(-1)
        assert len(set(ids.tolist())) == ids.size
        tokens = mask.reshape(len(mask), -1, 8).any(-1)  # a page holding a token (a filler row's first one too)
        assert tokens[page_ids < pool].all()
        written += page_ids[page_ids < pool].tolist()
    assert sorted(written) == list(range(1, 1 + prompt_pages))  # the sequences' pages, each once
    cache = calls[-1][2]
    for layer in cache:
        for pages in (layer.k, layer.v):
            nonzero = np.abs(np.asarray(pages, np.float32)).sum(axis=(0, 2, 3)) > 0
            assert nonzero[1:1 + prompt_pages].all() and not nonzero[0] and not nonzero[1 + prompt_pages:].any()
    pages = cache[0].k
    text = jax.jit(paged._set_pages).lower(pages, np.array([1, pool], np.int32), pages[:, :2]).as_text()
    assert "unique_indices = true" in text or "unique_indices=true" in text, text[:2000]


def test_rows_continued_from_their_kept_pages_sample_what_the_uninterrupted_generation_does(monkeypatch):
    """``keep``: a generation that stops early copies its unfinished rows' keys, values and next-token logits out of
    its pool; later generations place them (nothing prefilled) and continue the rows — running ones, and ones that
    waited for a slot with their carried tokens — to exactly the tokens, and the log-probs, of one generation."""
    from jrl.rollout import paged

    model = tiny_model("llama", seed=5)
    prompts = random_prompts(np.random.default_rng(6), LENGTHS)
    params = SamplingParams(max_new_tokens=40, temperature=1.0, stop_token_ids=STOPS)
    kv = KVCacheConfig(layout="paged", page_size=8, round_steps=4, slots=4)
    graphdef, state = nnx.split(model)
    whole = generate_paged(graphdef, [state], new_groups(prompts, 3), params, seed=7, kv=kv, pad_id=PAD,
                           prompt_bucket=8, slot_bucket=row_bucket)
    prefilled = []
    prefill = paged._prefill

    def recording(graphdef, state, cache, ids, mask, page_ids, *, page_size):
        prefilled.append(int(np.asarray(mask).sum(1).max()))  # the longest sequence prefilled
        return prefill(graphdef, state, cache, ids, mask, page_ids, page_size=page_size)

    monkeypatch.setattr(paged, "_prefill", recording)
    # the second generation has fewer slots than rows with tokens: some wait through it
    kvs = (dataclasses.replace(kv, slots=8), dataclasses.replace(kv, slots=2), kv)
    tokens, logprobs, outs = continue_from_kept(graphdef, [state], prompts, params, kvs, g=3, needed=(1, 1, 0))
    assert len(outs) == 3 and prefilled
    # Only prompts are prefilled (those of rows that had not started); no row's prompt and tokens are.
    assert max(prefilled) <= max(LENGTHS), prefilled
    first, second = outs[0], outs[1]
    held = [j for j, row in enumerate(first["kept"]) if row is not None]
    assert all(first["mask"][j].any() for j in held) and not any(first["kept"][j] for j in
                                                                 np.flatnonzero(first["finished"]))
    waited = [j for j, row in enumerate(second["kept"]) if row is not None and not second["mask"][j].any()]
    assert waited, "some carried rows should have waited for a slot through the second generation"
    # kept: every unfinished row with tokens (from the first generation or this one); none for the others
    had = first["mask"][~first["finished"]].any(axis=1)
    assert [row is not None for row in second["kept"]] == [
        bool(not done and (h or m.any())) for done, h, m in zip(second["finished"], had, second["mask"])]
    assert second["keep_s"] >= 0 and outs[2]["finished"].all()
    for r in range(len(tokens)):
        n = int(whole["mask"][r].sum())
        assert tokens[r] == whole["tokens"][r, :n].tolist()
        np.testing.assert_allclose(logprobs[r], whole["logprobs"][r, :n], rtol=1e-5, atol=1e-5)


def test_a_kept_row_continues_from_the_logits_and_pages_of_the_weights_that_left_them():
    """Kept pages are not recomputed: a row continued under new weights draws its next token from the logits the
    old weights left (its recorded log-prob is that distribution's), where a prefilled row draws from the new ones'."""
    old, new = tiny_model("llama", seed=5), tiny_model("llama", seed=6)
    prompts = random_prompts(np.random.default_rng(6), LENGTHS)
    params = SamplingParams(max_new_tokens=24, temperature=1.0, stop_token_ids=STOPS)
    kv = KVCacheConfig(layout="paged", page_size=8, round_steps=4, slots=16)
    graphdef, state = nnx.split(old)
    first = generate_paged(graphdef, [state], new_groups(prompts, 3), params, seed=7, kv=kv, pad_id=PAD,
                           prompt_bucket=8, slot_bucket=row_bucket, groups_needed=1, keep=True)
    rest = [j for j in range(len(first["finished"])) if not first["finished"][j] and first["mask"][j].any()]
    assert rest
    prefixes = [first["tokens"][j, :int(first["mask"][j].sum())].tolist() for j in rest]
    new_graphdef, new_state = nnx.split(new)
    seqs = {}
    for name, kept in (("kept", True), ("prefilled", False)):
        groups = [RowGroup(prompts[j // 3], [p], [j], (first["kept"][j] if kept else None,))
                  for j, p in zip(rest, prefixes)]
        out = generate_paged(new_graphdef, [new_state], groups, params, seed=7, kv=kv, pad_id=PAD, prompt_bucket=8,
                             slot_bucket=row_bucket)
        seqs[name] = out
    for name, model in (("kept", old), ("prefilled", new)):
        out = seqs[name]
        batch = _continuation_batch([prompts[j // 3] + p for j, p in zip(rest, prefixes)], out)
        reference = full_forward_logprobs(model, batch, 1.0)[:, 0]
        np.testing.assert_allclose(out["logprobs"][:, 0], reference, rtol=1e-5, atol=1e-5)
    assert np.abs(seqs["kept"]["logprobs"][:, 0] - seqs["prefilled"]["logprobs"][:, 0]).max() > 1e-3


def _continuation_batch(sequences, out):
    """A rollout batch whose prompts are ``sequences`` (prompt and prefix) and completions ``out``'s rows."""
    from jrl.rollout.paged import rollout_of

    return rollout_of(out, sequences, pad_id=PAD, prompt_bucket=8, version=0)
