"""The default EBFT strided run: the shipped tiny byte-level model on documents of the built-in arithmetic
task (chat-rendered prompt + reference ``solution`` + EOS), blocks of 8 tokens generated every 4 tokens of
the completion from an 8-token context window and matched to the document in feature space; offline on
CPU in a few minutes.

    python scripts/train.py --config configs/ebft_strided.py
"""

from __future__ import annotations

from jrl.data.pipeline import DataConfig
from jrl.sharding import MeshConfig
from jrl.rollout.config import RolloutConfig
from jrl.train.config import ModelSpec, OptimConfig, TrainConfig
from jrl.train.ebft_config import EBFTConfig


def config() -> TrainConfig:
    return TrainConfig(
        algorithm="ebft_strided",
        model=ModelSpec(path="models/tiny-arithmetic", dtype="float32"),
        lora=None,
        mesh=MeshConfig(fsdp=-1),
        data=DataConfig(source="builtin:arithmetic", prompts_per_batch=8, max_prompt_length=64, seed=0),
        rollout=RolloutConfig(temperature=1.0, top_p=1.0),  # the blocks' sampling
        ebft=EBFTConfig(feature_layers=(0.25, 0.5, 0.75), embed_method="last_token",
                        use_whitening=False, alignment_coef=1.0, diversity_coef=1.0, ce_coef=0.0,
                        gt_column="solution", context_length=8, stride=4, generate_max_len=8,
                        n_samples_per_prompt=4, min_completion_prefix=0,
                        advantage_estimator="rloo", rl_coef=1.0),
        optim=OptimConfig(learning_rate=1e-4, warmup_steps=5, schedule="constant", max_grad_norm=1.0),
        max_steps=150,
        output_dir="runs/ebft_strided",
        seed=0,
        save_every=50,
        log_every=25,
    )
