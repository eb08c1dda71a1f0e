"""Orbax checkpoints of the learner: exact round trip, interrupted saves, exact resume, export."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from train_testlib import grpo_learner, random_step_batch, tiny_model

from jrl.data.pipeline import DataConfig, make_prompt_loader
from jrl.data.tokenizer import load_byte_tokenizer
from jrl.losses import GRPOConfig
from jrl.train.checkpoint import TrainCheckpointer
from jrl.train.config import OptimConfig

ALGO = GRPOConfig(num_generations=2, metrics="basic")


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_save_restore_round_trip_and_interrupted_save(tmp_path):
    learner, update = grpo_learner(tiny_model(seed=0), ALGO, OptimConfig(learning_rate=1e-2), total_updates=4)
    update(learner, random_step_batch(seed=1))
    ckpt = TrainCheckpointer(tmp_path / "ckpt")
    meta = {"step": 1, "num_updates": learner.num_updates, "data_state": {"x": [1, 2]}}
    ckpt.save(1, learner.params, learner.opt_state, meta)
    ckpt.close()
    # A save that crashed half way leaves orbax's temporary directory behind, never a finalised step.
    partial = tmp_path / "ckpt" / "2.orbax-checkpoint-tmp-1234567890"
    (partial / "params").mkdir(parents=True)
    (partial / "params" / "garbage").write_bytes(b"\x00" * 10)

    fresh, _ = grpo_learner(tiny_model(seed=9), ALGO, OptimConfig(learning_rate=1e-2), total_updates=4)
    assert any(np.any(a != b) for a, b in zip(_leaves(fresh.params), _leaves(learner.params)))
    ckpt = TrainCheckpointer(tmp_path / "ckpt")
    assert ckpt.latest_step() == 1
    params, opt_state, got_meta = ckpt.restore(fresh.params, fresh.opt_state)
    ckpt.close()
    assert got_meta == meta
    for a, b in zip(_leaves(params), _leaves(learner.params), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_leaves(opt_state), _leaves(learner.opt_state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert jax.tree.structure(params) == jax.tree.structure(learner.params)


def test_a_config_mismatch_moves_no_checkpoint_aside(tmp_path):
    """Every checkpoint failing to restore (here: another model size) is not damage: nothing is moved and the
    error names each checkpoint."""
    learner, _ = grpo_learner(tiny_model(seed=0), ALGO, OptimConfig(learning_rate=1e-2), total_updates=4)
    ckpt = TrainCheckpointer(tmp_path / "ckpt")
    for step in (1, 2):
        ckpt.save(step, learner.params, learner.opt_state, {"step": step})
    wider, _ = grpo_learner(tiny_model(seed=0, intermediate_size=96), ALGO, OptimConfig(learning_rate=1e-2),
                            total_updates=4)
    with pytest.raises(RuntimeError, match=r"no checkpoint in .* restores .*: 2 \(.*; 1 \("):
        ckpt.restore(wider.params, wider.opt_state)
    ckpt.close()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["1", "2"]


def _run(parts, loader, steps, log):
    """Steps of the learner on rollouts drawn deterministically from each prompt batch."""
    learner, update = parts
    for _ in range(steps):
        batch = next(loader)
        seed = sum(batch.indices) * 1000 + learner.num_updates
        m = update(learner, random_step_batch(seed=seed, n=8))
        log.append({k: m[k] for k in ("loss", "grad_norm", "num_tokens", "learning_rate")} | {"idx": batch.indices})


def test_resume_continues_exactly(tmp_path):
    tok = load_byte_tokenizer()
    data = DataConfig(prompts_per_batch=2, max_prompt_length=64, seed=3)
    optim = OptimConfig(learning_rate=1e-2, warmup_steps=2, schedule="cosine")
    straight_log, resumed_log = [], []
    straight = grpo_learner(tiny_model(seed=0), ALGO, optim, total_updates=6)
    _run(straight, make_prompt_loader(data, tok), 6, straight_log)

    first = grpo_learner(tiny_model(seed=0), ALGO, optim, total_updates=6)
    loader = make_prompt_loader(data, tok)
    _run(first, loader, 3, resumed_log)
    first = first[0]
    ckpt = TrainCheckpointer(tmp_path / "ckpt")
    ckpt.save(3, first.params, first.opt_state, {"num_updates": first.num_updates, "data": loader.get_state()})
    ckpt.close()
    del first, loader

    second_parts = grpo_learner(tiny_model(seed=0), ALGO, optim, total_updates=6)
    second = second_parts[0]
    ckpt = TrainCheckpointer(tmp_path / "ckpt")
    params, opt_state, meta = ckpt.restore(second.params, second.opt_state)
    ckpt.close()
    second.params, second.opt_state, second.num_updates = params, opt_state, meta["num_updates"]
    loader = make_prompt_loader(data, tok)
    loader.set_state(json.loads(json.dumps(meta["data"])))
    _run(second_parts, loader, 3, resumed_log)
    assert resumed_log == straight_log
    for a, b in zip(_leaves(second.params), _leaves(straight[0].params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_restore_without_checkpoint_is_a_clear_error(tmp_path):
    learner, _ = grpo_learner(tiny_model(seed=0), ALGO, OptimConfig(), total_updates=1)
    ckpt = TrainCheckpointer(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        ckpt.restore(learner.params, learner.opt_state)
    ckpt.close()


def test_export_refuses_a_foreign_directory_and_keeps_its_files(tmp_path):
    """A non-empty target that is not an earlier export is refused before anything is written; an earlier export
    may be written again; --overwrite replaces a foreign one."""
    from jrl.train.export import EXPORT_MARKER, check_export_target

    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"not empty and not an earlier export .*notes.txt.*--overwrite"):
        check_export_target(target, overwrite=False)
    assert (target / "notes.txt").read_text() == "keep me"
    check_export_target(target, overwrite=True)  # the user said so
    check_export_target(tmp_path / "new", overwrite=False)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / EXPORT_MARKER).write_text("x")
    (earlier / "model.safetensors").write_bytes(b"")
    check_export_target(earlier, overwrite=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        check_export_target(tmp_path / "file", overwrite=False)


def test_metrics_jsonl_is_strict_json(tmp_path):
    from jrl.train.observability import MetricsWriter

    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.write(1, {"loss": 0.5, "reward/mean": float("nan"), "ratio": float("inf")})
    writer.close()

    def refuse(token):
        raise ValueError(f"non-strict JSON token {token}")

    rows = [json.loads(line, parse_constant=refuse) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 0.5, "reward/mean": None, "ratio": None}]
    assert writer.history() == rows
