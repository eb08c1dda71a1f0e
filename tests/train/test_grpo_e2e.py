"""The GRPO loop with the embedded sampler: exact resume, sampler/trainer agreement, a 2-device run."""

from __future__ import annotations

import dataclasses
import logging
import re

import numpy as np
import pytest

from jrl.data.pipeline import DataConfig
from jrl.losses import GRPOConfig
from jrl.train.config import ModelSpec, OptimConfig, RolloutConfig, ScoringConfig, TrainConfig
from jrl.rewards.functions import RewardSpec
from train_testlib import read_metrics_log, run_worker, save_tiny_model_dir, write_reward_file

#: Rewards in the trainer's process, where the crash reward's KeyboardInterrupt kills the run.
IN_PROCESS = ScoringConfig(num_workers=0)


def _cfg(model_dir, out, reward, **kw) -> TrainConfig:
    cfg = TrainConfig(
        model=ModelSpec(path=str(model_dir)), data=DataConfig(prompts_per_batch=2, max_prompt_length=64, seed=1),
        rollout=RolloutConfig(max_new_tokens=6, temperature=0.9), rewards=(RewardSpec(path=f"{reward}:low_ids"),),
        algo=GRPOConfig(num_generations=4, loss_type="grpo"),
        optim=OptimConfig(learning_rate=3e-3, warmup_steps=2, schedule="cosine", micro_batch_size=4),
        output_dir=str(out), max_steps=6, save_every=3, seed=5)
    return dataclasses.replace(cfg, **kw)


def test_resume_gives_identical_metrics(tiny_model_dir, tmp_path, caplog):
    from jrl.train.trainer import train

    ok = write_reward_file(tmp_path, "reward_ok")
    straight = train(_cfg(tiny_model_dir, tmp_path / "a", ok), progress=False)
    assert len(straight) == 6 and any(r["skipped_zero_adv_batches"] < 2 for r in straight)
    # The second run dies during step 4 (after the step-3 checkpoint), then resumes to step 6.
    crash = write_reward_file(tmp_path, "reward_crash", crash=3)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(tiny_model_dir, tmp_path / "b", crash, scoring=IN_PROCESS), progress=False)
    assert len(read_metrics_log(tmp_path / "b")) == 3
    train(_cfg(tiny_model_dir, tmp_path / "b", ok, resume=True), progress=False)
    a, b = read_metrics_log(tmp_path / "a"), read_metrics_log(tmp_path / "b")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert a == b
    assert (tmp_path / "b" / "curves.png").stat().st_size > 0
    assert list((tmp_path / "b" / "tensorboard").iterdir())

    # SIGTERM during step 2: the step finishes, a checkpoint is written at step 2, the run returns; resumed, it
    # reproduces the uninterrupted run.
    stopped = train(_cfg(tiny_model_dir, tmp_path / "c", write_reward_file(tmp_path, "reward_term", sigterm=2)),
                    progress=False)
    assert [r["step"] for r in stopped] == [1, 2]
    assert sorted(int(p.name) for p in (tmp_path / "c" / "checkpoints").iterdir()) == [2]
    train(_cfg(tiny_model_dir, tmp_path / "c", ok, resume=True), progress=False)
    assert read_metrics_log(tmp_path / "c") == a

    # A truncated file in the latest checkpoint (6): --resume-from 6 names it; --resume warns, moves it aside,
    # falls back to 3 and reproduces steps 4-6.
    damaged = max((p for p in (tmp_path / "b" / "checkpoints" / "6").rglob("*") if p.is_file()),
                  key=lambda p: p.stat().st_size)
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    with pytest.raises(RuntimeError, match="checkpoint 6 in .* is damaged"):
        train(_cfg(tiny_model_dir, tmp_path / "b", ok, resume_from=6), progress=False)
    with caplog.at_level(logging.WARNING, logger="jrl.train.checkpoint"):
        train(_cfg(tiny_model_dir, tmp_path / "b", ok, resume=True), progress=False)
    warnings = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "checkpoint 6 is damaged" in warnings[0] and "resuming from checkpoint 3" in warnings[0]
    assert (tmp_path / "b" / "checkpoints" / "damaged-6").is_dir()
    assert read_metrics_log(tmp_path / "b") == a

    # Export of the final checkpoint loads and reproduces the trained policy's log-probs.
    from jrl.models import from_pretrained
    from jrl.train.export import export_checkpoint

    out = export_checkpoint(tmp_path / "b", tmp_path / "hf")
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert from_pretrained(out, dtype="float32").config.num_hidden_layers == 1


def test_a_run_without_learning_signal_warns_once(tiny_model_dir, tmp_path, caplog):
    """A constant reward gives every group zero advantage: after FLAT_REWARD_STEPS such steps one warning."""
    from jrl.train.algorithms.grpo import FLAT_REWARD_STEPS
    from jrl.train.trainer import train

    constant = tmp_path / "reward_constant.py"
    constant.write_text("def one(prompts, completions, completion_ids, **kw):\n    return [1.0] * len(completions)\n")
    cfg = _cfg(tiny_model_dir, tmp_path / "flat", constant, max_steps=FLAT_REWARD_STEPS + 1, save_every=0,
               rewards=(RewardSpec(path=f"{constant}:one"),))
    with caplog.at_level(logging.WARNING, logger="jrl.train.algorithms.grpo"):
        history = train(cfg, progress=False)
    assert all(r["skipped_zero_adv_batches"] > 0 for r in history)
    warnings = [r.getMessage() for r in caplog.records if "nothing is learned" in r.getMessage()]
    assert len(warnings) == 1 and f"steps 1-{FLAT_REWARD_STEPS}:" in warnings[0]


@pytest.mark.parametrize("cache", ["on", None])
def test_a_run_logs_what_the_compilation_cache_did(tiny_model_dir, tmp_path, caplog, cache):
    from jrl.train.trainer import train

    reward = write_reward_file(tmp_path, "reward_cache")
    cfg = _cfg(tiny_model_dir, tmp_path / "run", reward, max_steps=1, save_every=0,
               compile_cache_dir=None if cache is None else str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger="jrl.train.trainer"):
        train(cfg, progress=False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compilation cache ")]
    if cache is None:
        assert lines == []
    else:  # one line at the end; a pytest process keeps the first cache directory any test gave it
        assert len(lines) == 1 and re.fullmatch(
            r"compilation cache \S+: \d+ programs loaded \(\d+\.\d s of compiling saved\), \d+ compiled and "
            r"written", lines[0]), lines


def test_sampler_and_trainer_logprobs_agree(tiny_model_dir):
    from transformers import AutoTokenizer

    from jrl.models import from_pretrained
    from jrl.rollout.jax_engine import JaxRolloutEngine
    from jrl.train.algorithms.grpo_update import build_step_batch
    from jrl.train.config import RolloutConfig
    from train_testlib import grpo_learner

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    model = from_pretrained(tiny_model_dir, dtype="float32")
    rollout_cfg = RolloutConfig(max_new_tokens=8, temperature=0.7)
    learner, update = grpo_learner(model, GRPOConfig(num_generations=3), total_updates=1, temperature=0.7)
    engine = JaxRolloutEngine(learner.model, pad_id=tok.pad_token_id)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in ("What is 1+2?", "What is 9-4?")]
    prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
    rollout = engine.generate(prompts, rollout_cfg.sampling_params((tok.eos_token_id,)), num_generations=3, seed=11)
    batch = build_step_batch(rollout, np.zeros(6, np.float32), pad_id=tok.pad_token_id, completion_length=8)
    trainer_lp = learner.evaluate(update.logprobs, batch)
    m = batch.completion_mask > 0
    assert m.sum() > 0
    assert np.max(np.abs(trainer_lp[m] - batch.sampler_logprobs[m])) <= 1e-4


def test_two_device_mesh_run(tiny_model_dir, tmp_path):
    reward = write_reward_file(tmp_path, "reward_mesh")
    out = run_worker("e2e_worker.py", tiny_model_dir, tmp_path / "run", reward, "2")
    assert out["devices"] == 2 and out["mesh_shape"]["fsdp"] == 2
    assert out["layers_per_gather"] == 0  # the automatic choice on a CPU: each layer gathered in its checkpoint
    assert [r["step"] for r in out["history"]] == [1, 2]
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["reward/mean"]) for r in out["history"])
    assert (tmp_path / "run" / "checkpoints" / "2").is_dir()
    # The layers gathered two at a time (the GPU default where the weights fit) train the same run.
    grouped = run_worker("e2e_worker.py", tiny_model_dir, tmp_path / "grouped", reward, "2", "2")
    assert grouped["layers_per_gather"] == 2
    for a, b in zip(grouped["history"], out["history"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6) and a["reward/mean"] == b["reward/mean"]


def test_a_moe_model_on_the_default_mesh_trains_expert_parallel(tmp_path):
    """Left on the default mesh, a mixture-of-experts model trains with its experts split over the devices
    (``jrl.sharding.learner_mesh``), through the trainer: finite steps and a checkpoint."""
    moe = save_tiny_model_dir(tmp_path / "moe", model_type="qwen3_moe", qk_norm=True, head_dim=8, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=16)
    out = run_worker("e2e_worker.py", moe, tmp_path / "run", write_reward_file(tmp_path, "reward_moe"), "-1")
    assert out["devices"] == 2 and out["mesh_shape"]["expert"] == 2 and out["mesh_shape"]["fsdp"] == 1
    assert [r["step"] for r in out["history"]] == [1, 2]
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["reward/mean"]) for r in out["history"])
    assert (tmp_path / "run" / "checkpoints" / "2").is_dir()


def test_sharded_step_equals_single_device():
    """§12.3: the gradient of a 2-device FSDP step (2 micro-batches) equals the 1-device, 1-micro-batch one, and is
    sharded as the parameters (an accumulator left to the compiler sat on one device or replicated); so does
    a step of packed rows on the mesh (micro-batches of 2 packed rows, through the log-prob kernel or the loss-fused
    head, with each pair's prompt shared, or one of a power of two of at least 2 rows: split over the devices)."""
    out = run_worker("mesh_step_worker.py")
    # 2 packed rows per micro-batch through either head (shared prompts too); one micro-batch
    assert len(out["packed"]) == 4 and [k for k, v in out["packed"].items() if v["shared"]] == ["2_fused_True"]
    for packed in out["packed"].values():
        assert packed["rows"] % 2 == 0 and packed["rows"] < 8 and packed["grad_err"] <= 1e-5
        assert packed["loss"] == pytest.approx(out["loss"][1], rel=1e-5)
    assert out["devices"] == 2 and out["param_devices"] == 2
    # the accumulated gradient sharded as the parameters, its micro-batches one program (not one per layout)
    assert out["grad_layout"] and out["micro_batches"] >= 2 and out["micro_programs"] == 1
    # ... and the same program after an optimizer update and with a micro-batch skipped (one for a new shape)
    assert out["later_skipped"] == 1 and out["later_programs"] == 1
    # the log-prob kernel runs on each device's rows: a micro-batch of 4 rows x 6 tokens as 2 x 6 per device, never
    # as the whole 24 (a custom call on GPUs, which XLA's partitioner would run on every row on every device)
    assert 12 in out["kernel_rows"] and 24 not in out["kernel_rows"], out["kernel_rows"]
    # an MoE model's head runs per device as well: the same gradient and old log-probs as on one device
    assert out["moe_err"]["grad"] <= 1e-5 and out["moe_err"]["old_logprobs"] <= 1e-5, out["moe_err"]
    assert out["grad_err"] <= 1e-5 and out["param_err"] <= 1e-5
    assert out["loss"][0] == pytest.approx(out["loss"][1], rel=1e-5)
    assert out["grad_norm"][0] == pytest.approx(out["grad_norm"][1], rel=1e-5)


def test_lora_run_exports_merged_model(tiny_model_dir, tmp_path):
    import jax.numpy as jnp

    from jrl.models import from_pretrained
    from jrl.models.lora import LoraConfig, lora_layers
    from jrl.train.export import export_checkpoint
    from jrl.train.trainer import Trainer

    reward = write_reward_file(tmp_path, "reward_lora")
    cfg = _cfg(tiny_model_dir, tmp_path / "run", reward, max_steps=2, save_every=0,
               lora=LoraConfig(rank=2, alpha=4.0, target_modules=("q_proj", "v_proj", "up_proj")),
               optim=OptimConfig(learning_rate=5e-2, micro_batch_size=4))
    trainer = Trainer(cfg, progress=False)
    trainer.train()
    trainer.close()
    trained = trainer.learner.model
    assert max(float(jnp.max(jnp.abs(x.lora_b[...]))) for x in lora_layers(trained).values()) > 0
    adapter = export_checkpoint(tmp_path / "run", tmp_path / "adapter", adapter_only=True)
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "adapter_config.json").is_file()
    out = export_checkpoint(tmp_path / "run" / "checkpoints" / "2", tmp_path / "merged")
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 262, (2, 9)), jnp.int32)
    want = trained(ids)
    got = from_pretrained(out, dtype="float32")(ids)
    base = from_pretrained(tiny_model_dir, dtype="float32")(ids)
    assert float(jnp.max(jnp.abs(want - base))) > 1e-4  # the adapters changed the model
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def test_expert_lora_run_trains_samples_and_exports(tmp_path):
    """A MoE run with LoRA on the experts, routers and q_proj (embedded sampler on the adapted model): the adapters
    train, the checkpoint exports as a PEFT adapter with target_parameters and as a merged model that computes the
    trained forward."""
    import json

    import jax.numpy as jnp

    from jrl.models import from_pretrained
    from jrl.models.lora import MOE_LORA_TARGETS, LoraConfig
    from jrl.train.export import export_checkpoint
    from jrl.train.trainer import Trainer

    model_dir = save_tiny_model_dir(tmp_path / "moe", seed=3, model_type="qwen3_moe", qk_norm=True, num_experts=4,
                                    num_experts_per_tok=2, moe_intermediate_size=16)
    reward = write_reward_file(tmp_path, "reward_moe")
    lora = LoraConfig(rank=2, alpha=4.0, target_modules=("q_proj",), target_parameters=MOE_LORA_TARGETS)
    cfg = _cfg(model_dir, tmp_path / "run", reward, max_steps=2, save_every=0, lora=lora,
               optim=OptimConfig(learning_rate=5e-2, micro_batch_size=4))
    trainer = Trainer(cfg, progress=False)
    trainer.train()
    trainer.close()
    trained = trainer.learner.model
    experts = trained.layers.mlp.experts
    assert float(jnp.max(jnp.abs(experts.lora_down_b[...]))) > 0 and float(jnp.max(jnp.abs(experts.lora_up_b[...]))) > 0
    adapter = export_checkpoint(tmp_path / "run", tmp_path / "adapter", adapter_only=True)
    meta = json.loads((adapter / "adapter_config.json").read_text())
    assert meta["target_parameters"] == list(MOE_LORA_TARGETS) and meta["target_modules"] == ["q_proj"]
    out = export_checkpoint(tmp_path / "run" / "checkpoints" / "2", tmp_path / "merged")
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 262, (2, 9)), jnp.int32)
    want = trained(ids)
    got = from_pretrained(out, dtype="float32")(ids)
    assert float(jnp.max(jnp.abs(want - from_pretrained(model_dir, dtype="float32")(ids)))) > 1e-4
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def test_a_run_on_the_paged_sampler_trains_and_resumes_exactly(tiny_model_dir, tmp_path):
    """``rollout.kv.layout='paged'`` with fewer decode slots than rows and a pool that preempts: the run trains, and
    a resumed run reproduces it (the paged sampler's rows sample from keys of their own)."""
    from jrl.envs import EnvConfig
    from jrl.rollout.kv_config import KVCacheConfig
    from jrl.train.trainer import train

    ok = write_reward_file(tmp_path, "reward_ok")
    paged = dataclasses.replace(RolloutConfig(max_new_tokens=6, temperature=0.9),
                                kv=KVCacheConfig(layout="paged", page_size=4, round_steps=4, slots=3, pages=24))
    straight = train(_cfg(tiny_model_dir, tmp_path / "a", ok, rollout=paged, max_steps=4, save_every=2),
                     progress=False)
    assert [r["step"] for r in straight] == [1, 2, 3, 4]
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["reward/mean"]) for r in straight)
    assert any(r["skipped_zero_adv_batches"] < 2 for r in straight)
    train(_cfg(tiny_model_dir, tmp_path / "b", ok, rollout=paged, max_steps=2, save_every=2), progress=False)
    train(_cfg(tiny_model_dir, tmp_path / "b", ok, rollout=paged, max_steps=4, save_every=2, resume=True),
          progress=False)
    resumed = read_metrics_log(tmp_path / "b")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4] and resumed == read_metrics_log(tmp_path / "a")
    with pytest.raises(ValueError, match=r"TrainConfig\.env\.reuse_kv_cache.*keeps no sessions"):
        _cfg(tiny_model_dir, tmp_path / "c", ok, rollout=paged, rewards=(), env=EnvConfig(name="higher_lower"))
