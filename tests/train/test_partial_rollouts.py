"""Partial rollouts (``rollout.partial``, :mod:`jrl.sources.partial`) on the paged sampler: each step trains on whole
finished groups, the rows still running are carried and continued in later steps (no group lost or given twice),
the log-probs of carried tokens stay those they were sampled with (equal to a full forward while the weights do not
change, whether a carried row's keys and values are kept or prefilled again), rows with tokens older than
``max_staleness`` steps before the step that trains them start again (with one warning naming the knob), the carry
survives a checkpoint exactly (the consumed step's, while a producer runs ahead), and a run — synchronous or
generating ahead, carried rows' pages kept (the default) — trains and resumes to the same metrics."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging

import numpy as np
import pytest
from train_testlib import read_metrics_log, tiny_model, write_reward_file

from jrl.data.pipeline import PromptBatch
from jrl.rollout import SamplingParams
from jrl.rollout.jax_engine import JaxRolloutEngine
from jrl.rollout.kv_config import KVCacheConfig
from jrl.sources.partial import PartialRollouts

G, PER_STEP = 3, 2
PAGED = KVCacheConfig(layout="paged", page_size=4, round_steps=4, slots=8)
STOPS = tuple(range(3, 30))  # about one token in nine stops a row: ragged lengths


def _prompts(step: int, rng) -> PromptBatch:
    """Step ``step``'s new prompts, as the rollout source takes them: two batches at the first step, one after."""
    first = (0 if step == 0 else step + 1) * PER_STEP
    index = list(range(first, (step + 2) * PER_STEP))
    ids = [rng.integers(60, 200, int(rng.integers(2, 9))).tolist() for _ in index]
    return PromptBatch(prompt_ids=ids, prompt_texts=[str(x) for x in ids], prompts=[str(x) for x in ids],
                       columns={"answer": index}, indices=index)


def _full_forward_logprobs(model, rollout, temperature: float) -> np.ndarray:
    from jrl.train.algorithms.grpo_update import build_step_batch, completion_logprobs

    batch = build_step_batch(rollout, np.zeros(len(rollout.truncated), np.float32), pad_id=0,
                             completion_length=rollout.completion_ids.shape[1])
    return np.asarray(completion_logprobs(model, batch, temperature=temperature)[0])


def _generate(partial, engine, model, step: int, batch: PromptBatch, params):
    """Step ``step``'s partial rollout with the engine at that step's version, as a synchronous trainer syncs it."""
    engine.sync_weights(model, step)
    return partial.generate(engine, batch, params, step=step, seed=step)


def _setup(seed: int, keep_kv: bool = False):
    """A tiny model, a paged engine on it, sampling parameters with ragged stops, an empty carry and a generator."""
    model = tiny_model(seed=seed)
    params = SamplingParams(max_new_tokens=24, temperature=1.0, stop_token_ids=STOPS)
    partial = PartialRollouts(num_generations=G, groups_per_step=PER_STEP, max_staleness=1, pad_id=0,
                              keep_kv=keep_kv)
    return model, JaxRolloutEngine(model, pad_id=0, kv=PAGED), params, partial, np.random.default_rng(seed)


@pytest.mark.parametrize("keep_kv", [False, True], ids=["recompute", "keep"])
def test_steps_train_on_whole_groups_and_carry_the_rest(keep_kv):
    model, engine, params, partial, rng = _setup(2, keep_kv)
    given, continued, placed = [], 0.0, 0.0
    for step in range(6):
        out = _generate(partial, engine, model, step, _prompts(step, rng), params)
        rollout = out.rollout
        assert rollout.completion_ids.shape == (PER_STEP * G, 24) and len(out.prompt_batch) == PER_STEP
        lengths = rollout.completion_mask.sum(1)
        assert (lengths > 0).all()  # every row finished: stopped, or at max_new_tokens (truncated)
        ends = rollout.completion_ids[np.arange(len(lengths)), lengths - 1]
        assert np.array_equal(~rollout.truncated, np.isin(ends, params.stop_token_ids))
        assert (lengths[rollout.truncated] == 24).all()
        # the rows' prompts are their groups' prompts
        assert [list(p) for p in rollout.prompt_lists()] == [p for p in out.prompt_batch.prompt_ids for _ in range(G)]
        mask = rollout.completion_mask.astype(bool)
        reference = _full_forward_logprobs(model, rollout, 1.0)[:, :24]
        assert np.abs(rollout.sampling_logprobs - reference)[mask].max() <= 1e-4
        given += out.prompt_batch.indices
        continued += out.metrics["partial/tokens_from_earlier_steps"]
        placed += out.metrics.get("partial/kept_rows_placed", 0.0)
        carried = [g.prompt.indices[0] for g in partial.carry]
        assert len(carried) == PER_STEP  # one batch's worth of groups always in flight
        assert len(set(given)) == len(given) and set(given) | set(carried) == set(range((step + 2) * PER_STEP))
    assert continued > 0, "some rows should have been continued from an earlier step"
    assert (placed > 0) == keep_kv, "with keep_kv, carried rows continue from their kept pages (none without)"


def test_the_carry_survives_a_checkpoint_and_stale_rows_start_again(caplog):
    model, engine, params, partial, rng = _setup(3)
    outs = [_generate(partial, engine, model, step, _prompts(step, rng), params) for step in range(3)]
    assert any(r.tokens and not r.finished for g in partial.carry for r in g.rows)
    # A checkpoint keeps what the last consumed step left, not what a generation ahead of the trainer left since.
    partial.consumed(outs[1])
    ahead = json.loads(json.dumps(partial.state()))
    assert [g["prompt"]["indices"] for g in ahead] == [list(g.prompt.indices) for g in outs[1].carried]
    assert [g.prompt.indices for g in outs[1].carried] != [g.prompt.indices for g in outs[2].carried]
    partial.consumed(outs[2])
    restored = PartialRollouts(num_generations=G, groups_per_step=PER_STEP, max_staleness=1, pad_id=0)
    restored.load_state(json.loads(json.dumps(partial.state())))
    kept = copy.deepcopy(partial)
    batch = _prompts(3, rng)
    a, b = _generate(kept, engine, model, 3, batch, params), _generate(restored, engine, model, 3, batch, params)
    untimed = [{k: v for k, v in m.items() if not k.startswith("time/")} for m in (a.metrics, b.metrics)]
    assert np.array_equal(a.rollout.completion_ids, b.rollout.completion_ids) and untimed[0] == untimed[1]
    assert 0 < a.metrics["partial/slot_occupancy"] <= 1 and a.metrics["partial/decode_steps"] > 0
    assert a.metrics["time/rollout_prefill"] > 0 and a.metrics["time/rollout_decode"] > 0
    assert np.array_equal(a.rollout.sampling_logprobs, b.rollout.sampling_logprobs)
    assert a.prompt_batch == b.prompt_batch
    assert outs[2].carried == partial.carry, "a later generation changed the carry an earlier step left"
    # Step 4 with the sampler one version behind it (generation running ahead of the trainer): the carried tokens
    # (versions <= 2) are more than max_staleness=1 steps old for it, so their rows start again.
    running = sum(bool(r.tokens) for g in partial.carry for r in g.rows)
    fresh = PartialRollouts(num_generations=G, groups_per_step=PER_STEP, max_staleness=1, pad_id=0)
    fresh.load_state(partial.state())  # one that has not warned yet
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jrl.sources.partial"):
        out = fresh.generate(engine, batch, params, step=4, seed=3)
    assert out.metrics["partial/restarted_rows"] == running > 0
    assert out.metrics["partial/oldest_token_lag"] == 1  # every trained token sampled now, at version 3
    warned = [r.getMessage() for r in caplog.records if "started again" in r.getMessage()]
    assert len(warned) == 1 and f"{running} carried rows" in warned[0] and "rollout.max_staleness=1" in warned[0]


def _run_config(tiny_model_dir, tmp_path, out: str, ahead: int, **kw):
    """A partial GRPO run of 4 steps on the tiny model (checkpoints every 2), ``ahead`` = ``rollout.prefetch_depth``
    (the producer thread then runs each step's generation, continuing the carry the previous one left, while the
    trainer trains)."""
    from jrl.data.pipeline import DataConfig
    from jrl.losses import GRPOConfig
    from jrl.rewards.functions import RewardSpec
    from jrl.train.config import ModelSpec, OptimConfig, RolloutConfig, TrainConfig

    ok = write_reward_file(tmp_path, "reward_ok")
    rollout = RolloutConfig(max_new_tokens=12, temperature=0.9, partial=True, stop_token_ids=STOPS,
                            kv=dataclasses.replace(PAGED, slots=16), prefetch_depth=ahead, max_staleness=1 + ahead)
    return TrainConfig(model=ModelSpec(path=str(tiny_model_dir)),
                       data=DataConfig(prompts_per_batch=2, max_prompt_length=64, seed=1), rollout=rollout,
                       rewards=(RewardSpec(path=f"{ok}:low_ids"),), algo=GRPOConfig(num_generations=4, loss_type="grpo"),
                       optim=OptimConfig(learning_rate=3e-3, warmup_steps=2, micro_batch_size=4),
                       output_dir=str(tmp_path / out), **{"max_steps": 4, "save_every": 2, "seed": 5, **kw})


@pytest.mark.parametrize("ahead", [0, 1], ids=["synchronous", "generating-ahead"])
def test_a_partial_run_trains_resumes_exactly_and_is_refused_where_it_cannot_run(tiny_model_dir, tmp_path, ahead):
    from jrl.train.config import RolloutConfig, TrainConfig
    from jrl.train.trainer import train

    def cfg(out, **kw):
        return _run_config(tiny_model_dir, tmp_path, out, ahead, **kw)

    straight = train(cfg("a"), progress=False)
    assert [r["step"] for r in straight] == [1, 2, 3, 4]
    assert all(np.isfinite(r["loss"]) for r in straight)
    assert sum(r["partial/tokens_from_earlier_steps"] for r in straight) > 0
    # kept pages placed at steps 2 and 4; step 3's generation follows the checkpoint at 2 and prefills them
    assert straight[2].get("partial/kept_rows_placed") == 0 and sum(
        r.get("partial/kept_rows_placed", 0) for r in straight) > 0
    assert all(r["time/compile"] >= 0 for r in straight) and all(0 < r["partial/slot_occupancy"] <= 1
                                                                     for r in straight if "partial/decode_steps" in r)
    # The checkpoint at step 2 is a generation barrier; generation runs one step ahead at the other steps.
    assert [r["async/staleness"] for r in straight] == ([0, 0, 0, 0] if ahead == 0 else [0, 1, 0, 1])
    assert all(r["partial/oldest_token_lag"] <= 1 + ahead for r in straight)
    train(dataclasses.replace(cfg("b"), max_steps=2), progress=False)
    train(cfg("b", resume=True), progress=False)
    timing = ("tokens_per_second", "async/queue_depth")
    assert read_metrics_log(tmp_path / "b", timing) == read_metrics_log(tmp_path / "a", timing)
    if ahead:
        return
    rollout = cfg("c").rollout
    for change, field in ((dict(rollout=dataclasses.replace(rollout, kv=KVCacheConfig())), r"partial=True.*set "
                                                                                            r"rollout\.kv\.layout"),
                          (dict(rollout=dataclasses.replace(rollout, prefetch_depth=1)),
                           r"max_staleness=1 is invalid: .*at least 2 version\(s\) old .*prefetch_depth=1.*use "
                           r"max_staleness >= 2")):
        with pytest.raises(ValueError, match=r"TrainConfig\.rollout\." + field):
            dataclasses.replace(cfg("c"), **change)
    with pytest.raises(ValueError, match=r"rollout\.partial=True.*'ebft_structured' does not train on partial"):
        TrainConfig(algorithm="ebft_structured", rollout=RolloutConfig(partial=True, kv=PAGED))
    with pytest.raises(ValueError, match=r"TrainConfig\.rollout\.partial_kv='recompute'.*set rollout\.partial=True"):
        dataclasses.replace(cfg("c"), rollout=dataclasses.replace(rollout, partial=False, partial_kv="recompute"))


def test_a_checkpoint_taken_while_the_producer_is_ahead_keeps_the_consumed_steps_carry(tiny_model_dir, tmp_path):
    """Two steps trained, the producer's generation of step 3 taken from it (so it is done, and the carry it left is
    newer than the trained steps'): the algorithm's checkpoint state is the carry step 2 left — the groups step 3's
    generation went on with, less step 3's new prompts — not the producer's."""
    from jrl.train.trainer import Trainer

    trainer = Trainer(_run_config(tiny_model_dir, tmp_path, "a", 1, save_every=0), progress=False)
    try:
        trainer.train_step(), trainer.train_step()
        ahead, _, _ = trainer.source.next(2)
        saved = {g["prompt"]["indices"][0] for g in trainer.algorithm.state(2)["partial"]}
    finally:
        trainer.close()
    trained, new = set(ahead.rollout.prompt_batch.indices), set(ahead.prompt_batch.indices)
    left_by_step_3 = {g.prompt.indices[0] for g in ahead.rollout.carried}
    assert saved == (trained | left_by_step_3) - new
    assert saved != left_by_step_3, "the seeds should make step 3 train a carried group (else nothing is shown)"
