"""Adding an algorithm touches its own file and one registration line (tests/train/toy_algorithm.py): the toy
REINFORCE, with a config section of its own, trains through the config checks, the trainer, checkpoints and the
closing summary; the command line offers its section's flags; a field it declares it ignores, a section of another
algorithm and another algorithm's section type in its ``algo`` are refused when set."""

from __future__ import annotations

import json
import math

import pytest
from toy_algorithm import ToyConfig  # registers toy_reinforce

from jrl.cli.train import parse_config, summary
from jrl.data.pipeline import DataConfig
from jrl.data.tasks.arithmetic import ArithmeticConfig
from jrl.losses import GRPOConfig
from jrl.rollout.config import RolloutConfig
from jrl.sources.replay import ReplayConfig
from jrl.train.config import ModelSpec, OptimConfig, TrainConfig
from jrl.train.ebft_config import EBFTConfig
from jrl.train.trainer import train


def _cfg(model_dir, out, **changes) -> TrainConfig:
    return TrainConfig(model=ModelSpec(path=str(model_dir)), algorithm="toy_reinforce", output_dir=str(out),
                       data=DataConfig(prompts_per_batch=2, max_prompt_length=64, seed=1,
                                       arithmetic=ArithmeticConfig(num_examples=16)),
                       algo=ToyConfig(group_size=2), rollout=RolloutConfig(max_new_tokens=6),
                       optim=OptimConfig(learning_rate=1e-3), max_steps=3, save_every=2, seed=3, **changes)


def test_a_toy_algorithm_from_one_file_trains(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, tmp_path / "run")
    history = train(cfg, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in rows)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2", "3"]
    assert "reward/mean" in summary(cfg, history) and (tmp_path / "run" / "curves.png").is_file()


def test_a_field_it_ignores_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"TrainConfig\.replay=.*algorithm='toy_reinforce' does not use it"):
        _cfg(tiny_model_dir, tmp_path / "run", replay=ReplayConfig(buffer_size=4))


def test_its_section_of_another_type_or_another_algorithms_section_is_refused(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match=r"TrainConfig\.algo=GRPOConfig.*reads an algo section of type ToyConfig"):
        TrainConfig(model=ModelSpec(path=str(tiny_model_dir)), algorithm="toy_reinforce", algo=GRPOConfig())
    with pytest.raises(ValueError, match=r"TrainConfig\.ebft=.*algorithm='toy_reinforce' does not use it"):
        _cfg(tiny_model_dir, tmp_path / "run", ebft=EBFTConfig(alignment_coef=0.5))
    with pytest.raises(ValueError, match=r"TrainConfig\.algo\.group_size=1.*a baseline needs >= 2"):
        TrainConfig(model=ModelSpec(path=str(tiny_model_dir)), algorithm="toy_reinforce", algo=ToyConfig(group_size=1))
    assert TrainConfig(algorithm="toy_reinforce").algo == ToyConfig()  # None: the section's defaults


def test_the_command_line_offers_its_section(tiny_model_dir, capsys):
    cfg = parse_config(["--algorithm", "toy_reinforce", "--algo.group-size", "2", "--algo.advantage-scale", "0.5",
                        "--model.path", str(tiny_model_dir)])
    assert cfg.algo == ToyConfig(group_size=2, advantage_scale=0.5) and cfg.samples_per_prompt == 2
    with pytest.raises(SystemExit):
        parse_config(["--algorithm", "toy_reinforce", "--help"])
    flags = capsys.readouterr().out
    assert "--algo.group-size" in flags and "--algo.num-generations" not in flags
