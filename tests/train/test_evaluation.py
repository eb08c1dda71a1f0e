"""Held-out evaluation during a run: when it runs, what it logs (strict JSON, TensorBoard, offline W&B), which prompts
it uses, config errors."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from jrl.data.pipeline import DataConfig
from jrl.losses import GRPOConfig
from jrl.rollout.config import RolloutConfig
from jrl.train.config import ModelSpec, OptimConfig, TrainConfig
from jrl.train.evaluation import EvalConfig
from jrl.train.observability import MetricsWriter, WandbConfig
from jrl.rewards.functions import RewardSpec
from train_testlib import write_reward_file


def _cfg(model_dir, out, reward, **kw) -> TrainConfig:
    cfg = TrainConfig(
        model=ModelSpec(path=str(model_dir)), data=DataConfig(prompts_per_batch=2, max_prompt_length=64, seed=1),
        rollout=RolloutConfig(max_new_tokens=6, temperature=0.9), rewards=(RewardSpec(path=f"{reward}:low_ids"),),
        algo=GRPOConfig(num_generations=2), optim=OptimConfig(learning_rate=3e-3), output_dir=str(out), max_steps=3,
        save_every=2, seed=3, eval_every=1,
        eval=EvalConfig(holdout=5, batch_size=3, decodings=("greedy", "sampled"), num_samples=2))
    return dataclasses.replace(cfg, **kw)


def _strict_rows(path) -> list[dict]:
    def reject(token):
        raise ValueError(f"{path} holds {token}, which is not JSON")

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def test_eval_runs_on_held_out_prompts_and_logs_strict_json(tiny_model_dir, tmp_path):
    from jrl.train.trainer import Trainer

    pytest.importorskip("wandb", reason="the W&B sink needs the wandb package (the dev extra installs it)")
    reward = write_reward_file(tmp_path, "eval_reward")
    trainer = Trainer(_cfg(tiny_model_dir, tmp_path / "run", reward, wandb=WandbConfig(project="jrl-tests")),
                      progress=False)
    try:
        held_out = trainer.evaluator.prompts
        trained = trainer.loader.dataset
        assert len(held_out) == 5 and not set(held_out.source_rows) & set(trained.source_rows)
        assert len(trained) + 5 == trained.num_loaded - trained.num_filtered
        trainer.train()
    finally:
        trainer.close()
    rows = _strict_rows(tmp_path / "run" / "eval.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # before the first step, then every step
    for r in rows:
        for d in ("greedy", "sampled"):
            assert 0 <= r[f"eval/{d}/reward/low_ids/mean"] <= 1 and r[f"eval/{d}/reward/mean"] is not None
            assert 1 <= r[f"eval/{d}/completions/mean_length"] <= 6
    samples = _strict_rows(tmp_path / "run" / "eval_samples.jsonl")
    assert len(samples) == 4 * 2 * 2  # evals x decodings x num_samples
    first = [s for s in samples if s["step"] == 0]
    assert [s["decoding"] for s in first] == ["greedy", "greedy", "sampled", "sampled"]
    assert [s["prompt"] for s in first[:2]] == held_out.batch(range(2)).prompts
    for s in samples:  # the logged reward is the function's value on the logged completion's tokens' text
        assert set(s["rewards"]) == {"low_ids"} and s["reward"] == pytest.approx(s["rewards"]["low_ids"])
    assert list((tmp_path / "run" / "tensorboard" / "eval").iterdir())
    # the same run in W&B, offline (no network): one run file holding the step and eval metrics and the samples
    (wandb_run,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    data = wandb_run.read_bytes()
    keys = (b"reward/low_ids/mean", b"loss", b"eval/greedy/reward/mean", b"eval/sampled/samples")
    assert all(key in data for key in keys)


def test_greedy_eval_is_the_engine_at_top_k_1(tiny_model_dir, tmp_path):
    """The greedy decoding is the argmax continuation: the same completions whatever the seed."""
    from jrl.train.trainer import Trainer

    reward = write_reward_file(tmp_path, "eval_reward_g")
    texts = []
    for seed in (3, 4):
        cfg = _cfg(tiny_model_dir, tmp_path / f"g{seed}", reward, seed=seed, max_steps=1,
                   eval=EvalConfig(holdout=4, decodings=("greedy",), num_samples=4))
        trainer = Trainer(cfg, progress=False)
        try:
            writer = MetricsWriter(tmp_path / f"g{seed}", name="eval", tensorboard=False)
            trainer.evaluator.run(trainer.engine, 0, writer)
        finally:
            trainer.close()
        texts.append([s["completion"] for s in _strict_rows(tmp_path / f"g{seed}" / "eval_samples.jsonl")])
    assert texts[0] == texts[1] and len(texts[0]) == 4


def test_eval_settings_are_checked(tiny_model_dir, tmp_path):
    from jrl.train.trainer import Trainer

    reward = write_reward_file(tmp_path, "eval_reward_c")
    with pytest.raises(ValueError, match=r"TrainConfig.eval=.*eval_every=0 does not use it"):
        _cfg(tiny_model_dir, tmp_path, reward, eval_every=0)
    with pytest.raises(ValueError, match=r"TrainConfig.eval_every=3 is invalid: use a multiple of "
                                         r"rollout.sync_interval=2"):
        _cfg(tiny_model_dir, tmp_path, reward, eval_every=3, rollout=RolloutConfig(max_new_tokens=6, sync_interval=2))
    with pytest.raises(ValueError, match=r"WandbConfig.project=None is invalid: the W&B settings take effect only"):
        WandbConfig(mode="online")
    with pytest.raises(ValueError, match=r"EvalConfig.decodings=\('beam',\) is invalid"):
        EvalConfig(decodings=("beam",))
    with pytest.raises(ValueError, match=r"EvalConfig.holdout=5000 is invalid: the training source has \d+ prompts"):
        Trainer(_cfg(tiny_model_dir, tmp_path / "h", reward, eval=EvalConfig(holdout=5000)), progress=False)
    # an eval file: read with the data section's prompt column and template, nothing held out
    src = tmp_path / "eval.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"What is {i}+1?", "answer": i + 1}) + "\n" for i in range(3)))
    trainer = Trainer(_cfg(tiny_model_dir, tmp_path / "f", reward, eval=EvalConfig(source=str(src))), progress=False)
    try:
        assert trainer.evaluator.prompts.columns["answer"] == [1, 2, 3]
        assert trainer.loader.dataset.num_loaded == len(trainer.loader.dataset) + trainer.loader.dataset.num_filtered
        assert np.all(np.asarray([len(p) for p in trainer.evaluator.prompts.prompt_ids]) > 0)
    finally:
        trainer.close()
