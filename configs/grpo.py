"""The default GRPO run: the shipped tiny byte-level model on the built-in arithmetic task, offline on CPU.

    python scripts/train.py --config configs/grpo.py
"""

from __future__ import annotations

from jrl.data.pipeline import DataConfig
from jrl.losses import GRPOConfig
from jrl.sharding import MeshConfig
from jrl.rollout.config import RolloutConfig
from jrl.train.config import ARITHMETIC_REWARDS, ModelSpec, OptimConfig, TrainConfig


def config() -> TrainConfig:
    return TrainConfig(
        model=ModelSpec(path="models/tiny-arithmetic", dtype="float32"),
        lora=None,
        mesh=MeshConfig(fsdp=-1),
        data=DataConfig(source="builtin:arithmetic", prompts_per_batch=8, max_prompt_length=64, seed=0),
        rollout=RolloutConfig(backend="jax", max_new_tokens=24, temperature=1.0),
        rewards=ARITHMETIC_REWARDS,
        algo=GRPOConfig(num_generations=8, loss_type="dapo", beta=0.0),
        optim=OptimConfig(learning_rate=1e-4, warmup_steps=5, schedule="constant", max_grad_norm=1.0,
                          micro_batch_size=32),
        max_steps=300,
        output_dir="runs/grpo",
        seed=0,
        save_every=50,
        log_every=20,
    )
