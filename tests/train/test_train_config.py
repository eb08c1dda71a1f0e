"""TrainConfig loading, CLI overrides, --help, bad input errors, and scripts/train.py's closing summary."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jrl.data.pipeline import DataConfig
from jrl.losses import GRPOConfig
from jrl.sharding import MeshConfig
from jrl.train.config import ModelSpec, OptimConfig, ScoringConfig, TrainConfig, load_config_file
from jrl.rewards.functions import RewardError, RewardLoadError, RewardSpec

ROOT = Path(__file__).resolve().parents[2]


def _train_script():
    spec = importlib.util.spec_from_file_location("jrl_train_script", ROOT / "scripts" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_shipped_config_loads_and_overrides_apply():
    base = load_config_file(ROOT / "configs" / "grpo.py")
    assert isinstance(base, TrainConfig) and base.model.path == "models/tiny-arithmetic"
    cfg = _train_script().parse_config(["--config", str(ROOT / "configs" / "grpo.py"), "--max-steps", "3",
                                        "--output-dir", "runs/x", "--rollout.temperature", "0.8",
                                        "--algo.num-generations", "4", "--optim.learning-rate", "0.001"])
    assert (cfg.max_steps, cfg.output_dir, cfg.rollout.temperature) == (3, "runs/x", 0.8)
    assert cfg.algo.num_generations == 4 and cfg.optim.learning_rate == 0.001
    # Untouched fields keep the file's values, not the dataclass defaults.
    assert cfg.data == base.data and cfg.save_every == base.save_every


def test_rewards_from_the_command_line_and_a_hanging_one(tmp_path, monkeypatch):
    """``--rewards path:fn[=weight] ...`` replaces the config file's rewards; a function that never returns costs
    each step its timeout, its rows get no reward (null in a strict-JSON metrics.jsonl), the run goes on."""
    from jrl.train.trainer import train

    file = tmp_path / "cli_rewards.py"
    file.write_text("import time\n\n"
                    "def length(prompts, completions, completion_ids, **kw):\n"
                    "    return [len(c) / 10 for c in completions]\n\n"
                    "def hang(prompts, completions, completion_ids, **kw):\n"
                    "    time.sleep(10_000)\n")
    monkeypatch.chdir(ROOT)
    cfg = _train_script().parse_config(["--config", "configs/grpo.py", "--rewards", f"{file}:length=0.5",
                                        f"{file}:hang", "--scoring.timeout-s", "1", "--max-steps", "2",
                                        "--data.prompts-per-batch", "2", "--algo.num-generations", "4",
                                        "--optim.micro-batch-size", "8", "--output-dir", str(tmp_path / "run")])
    assert cfg.rewards == (RewardSpec(f"{file}:length", 0.5), RewardSpec(f"{file}:hang", 1.0))
    t0 = time.monotonic()
    train(cfg, progress=False)
    assert time.monotonic() - t0 < 120  # two 1 s timeouts, never the 10_000 s sleep

    def strict(token):
        raise ValueError(f"metrics.jsonl holds {token}, which is not JSON")

    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=strict) for line in lines]
    assert [r["reward/hang/timeouts"] for r in rows] == [1.0, 1.0]
    assert [r["reward/length/errors"] for r in rows] == [0.0, 0.0]
    assert all(r["reward/hang/mean"] is None and r["reward/length/mean"] > 0 for r in rows)
    assert all(np.isfinite(r["loss"]) for r in rows)
    with pytest.raises(SystemExit):
        _train_script().parse_config(["--config", "configs/grpo.py", "--rewards", "no_colon"])


def test_help_lists_every_documented_field():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--config",
                          str(ROOT / "configs" / "grpo.py"), "--help"], capture_output=True, text=True, timeout=120,
                         env={"COLUMNS": "200", "PATH": ""}, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    for flag in ["--max-steps", "--output-dir", "--seed", "--save-every", "--log-every", "--resume",
                 "--num-iterations", "--model.path", "--mesh.fsdp", "--data.source", "--rollout.temperature",
                 "--rollout.max-new-tokens", "--algo.num-generations", "--algo.beta", "--optim.learning-rate",
                 "--optim.micro-batch-size", "--logprobs-impl", "lora:lora-config", "--algorithm", "--ebft.stride",
                 "--algo.objective", "--rollout.sync"]:
        assert flag in text, flag
    assert "completions per prompt" in text  # field docstrings are shown
    assert "GRPO or EBFT training" in text and "ebft:ebft-config" not in text
    assert "--algo.temperature" not in text and "--ebft.temperature" not in text and "--ebft.mode" not in text


def test_run_summary_prints_the_metrics_of_the_run_kind():
    """The closing line of scripts/train.py gives the last step's ebft/alignment, ebft/cfm_loss and
    ebft/reward for an EBFT config and reward/mean for a GRPO one, skipping (never printing nan for) a
    metric the run did not log."""
    script = _train_script()
    rng = np.random.default_rng(0)
    keys = ("reward/mean", "ebft/alignment", "ebft/cfm_loss", "ebft/reward")
    history = [{"step": s, "loss": float(rng.normal()), **{k: float(rng.normal()) for k in keys}} for s in (1, 2)]
    last = history[-1]
    ebft_cfg, grpo_cfg = (load_config_file(ROOT / "configs" / f) for f in ("ebft.py", "grpo.py"))
    ebft_line = script.summary(ebft_cfg, history)
    assert ebft_line.startswith(f"done: 2 steps logged in {ebft_cfg.output_dir}/metrics.jsonl; last ")
    for key in ("ebft/alignment", "ebft/cfm_loss", "ebft/reward"):
        assert f"{key} {last[key]:.4f}" in ebft_line, (key, ebft_line)
    assert "reward/mean" not in ebft_line
    grpo_line = script.summary(grpo_cfg, history)
    assert f"last reward/mean {last['reward/mean']:.4f};" in grpo_line and "ebft/" not in grpo_line
    # A run that did not log one of them: the others, and no nan.
    partial = [{k: v for k, v in last.items() if k != "ebft/cfm_loss"}]
    line = script.summary(ebft_cfg, partial)
    assert "ebft/cfm_loss" not in line and "nan" not in line and f"ebft/reward {last['ebft/reward']:.4f}" in line
    assert "; last " not in script.summary(grpo_cfg, [{"step": 1, "loss": 0.5}])


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"algo\.num_generations=1"):
        TrainConfig(algo=GRPOConfig(num_generations=1))
    with pytest.raises(ValueError, match=r"optim\.micro_batch_size=5"):
        TrainConfig(data=DataConfig(prompts_per_batch=2), algo=GRPOConfig(num_generations=4),
                    optim=OptimConfig(micro_batch_size=5))
    with pytest.raises(ValueError, match="learning_rate"):
        OptimConfig(learning_rate=0.0)
    with pytest.raises(ValueError, match=r"ModelSpec\.expert_capacity=0\.5.*use 0 or a value >= 1"):
        ModelSpec(expert_capacity=0.5)
    with pytest.raises(ValueError, match=r"ModelSpec\.expert_chunks=0.*use 1 \(no chunks\)"):
        ModelSpec(expert_chunks=0)
    with pytest.raises(ValueError,
                       match=r"ModelSpec\.fsdp_layers_per_gather=-1.*use None \(automatic\), 0 \(each layer"):
        ModelSpec(fsdp_layers_per_gather=-1)
    with pytest.raises(SystemExit):  # tyro reports the error and exits non-zero
        _train_script().parse_config(["--config", str(ROOT / "configs" / "grpo.py"), "--algo.num-generations", "1"])


def _cfg(model_dir, tmp_path, **kw):
    base = TrainConfig(model=ModelSpec(path=str(model_dir)), data=DataConfig(prompts_per_batch=2, max_prompt_length=64),
                       algo=GRPOConfig(num_generations=2), output_dir=str(tmp_path / "run"), max_steps=1)
    return dataclasses.replace(base, **kw)


def test_trainer_bad_inputs(tiny_model_dir, tmp_path):
    from jrl.train.trainer import Trainer

    with pytest.raises(ValueError, match="MeshConfig"):
        Trainer(_cfg(tiny_model_dir, tmp_path, mesh=MeshConfig(fsdp=3)))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        Trainer(_cfg(tiny_model_dir, tmp_path, data=DataConfig(source=str(tmp_path / "missing.jsonl"))))
    with pytest.raises(RewardLoadError, match="no_such_module"):
        Trainer(_cfg(tiny_model_dir, tmp_path, rewards=(RewardSpec(path="no_such_module:fn"),)))
    with pytest.raises(FileNotFoundError, match="ModelSpec.path"):
        Trainer(_cfg(tmp_path, tmp_path))
    bad = tmp_path / "bad_reward.py"
    bad.write_text("def one_value(prompts, completions, completion_ids=None, **kw):\n    return [1.0]\n")
    trainer = Trainer(_cfg(tiny_model_dir, tmp_path, rewards=(RewardSpec(path=f"{bad}:one_value"),),
                           scoring=ScoringConfig(max_failed_steps=1)))
    try:
        batch = next(trainer.loader)
        rollout = trainer.algorithm.generate(trainer.engine, batch, step=0, seed=0)
        with pytest.raises(RewardError, match=r"'one_value' .* failed on every call of 1 consecutive steps "
                                              r"\(steps 8-8\); the last error: returned 1 values for \d+ completions") as e:
            trainer.algorithm.make_experience(rollout, batch, trainer.learner, 7)
        assert e.value.function == "one_value"
    finally:
        trainer.close()


def test_a_reward_that_is_nan_for_a_whole_step_is_reported(tiny_model_dir, tmp_path, caplog):
    from jrl.train.trainer import Trainer

    nan = tmp_path / "nan_reward.py"
    nan.write_text("def never(prompts, completions, completion_ids=None, **kw):\n    return [None] * len(completions)\n")
    trainer = Trainer(_cfg(tiny_model_dir, tmp_path, rewards=(RewardSpec(path="jrl.data.tasks.arithmetic:format_reward"),
                                                               RewardSpec(path=f"{nan}:never"))))
    try:
        batch = next(trainer.loader)
        rollout = trainer.algorithm.generate(trainer.engine, batch, step=0, seed=0)
        with caplog.at_level("WARNING", logger="jrl.train.algorithms.grpo"):
            _, metrics = trainer.algorithm.make_experience(rollout, batch, trainer.learner, 3)
    finally:
        trainer.close()
    warned = [r.getMessage() for r in caplog.records if "gave no reward" in r.getMessage()]
    assert len(warned) == 1 and "step 4" in warned[0] and "'never'" in warned[0]
    assert np.isnan(metrics["reward/never/mean"]) and np.isfinite(metrics["reward/format_reward/mean"])


def test_fresh_run_refuses_an_output_dir_holding_a_run(tmp_path):
    from jrl.train.observability import claim_output_dir

    out = tmp_path / "run"
    claim_output_dir(out, overwrite=False)  # nothing there yet: fine
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "checkpoints" / "1").mkdir(parents=True)
    (out / "notes.txt").write_text("kept")
    with pytest.raises(FileExistsError, match="--resume") as e:
        claim_output_dir(out, overwrite=False)
    assert "metrics.jsonl" in str(e.value) and "checkpoints" in str(e.value)
    assert (out / "metrics.jsonl").exists() and (out / "checkpoints" / "1").exists()
    claim_output_dir(out, overwrite=True)
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    assert (out / "notes.txt").read_text() == "kept"
