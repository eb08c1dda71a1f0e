"""Child process for test_grpo_e2e.py: a short GRPO run on fake CPU devices (XLA_FLAGS set by the parent).

argv: MODEL_DIR OUT_DIR REWARD_FILE FSDP (-1: the default mesh) [LAYERS_PER_GATHER]. Prints one JSON line with what
the parent asserts.
"""

import json
import sys

import jax

from jrl.data.pipeline import DataConfig
from jrl.losses import GRPOConfig
from jrl.sharding import MeshConfig
from jrl.train.config import ModelSpec, OptimConfig, RolloutConfig, TrainConfig
from jrl.train.trainer import Trainer
from jrl.rewards.functions import RewardSpec


def main(model_dir, out_dir, reward_file, fsdp, layers_per_gather=None):
    layers = None if layers_per_gather is None else int(layers_per_gather)
    cfg = TrainConfig(
        model=ModelSpec(path=model_dir, fsdp_layers_per_gather=layers), mesh=MeshConfig(fsdp=int(fsdp)),
        data=DataConfig(prompts_per_batch=2, max_prompt_length=64, seed=1),
        rollout=RolloutConfig(max_new_tokens=6), rewards=(RewardSpec(path=f"{reward_file}:low_ids"),),
        algo=GRPOConfig(num_generations=2), optim=OptimConfig(learning_rate=1e-3, micro_batch_size=2),
        output_dir=out_dir, max_steps=2, save_every=1)
    trainer = Trainer(cfg, progress=False)
    history = trainer.train()
    trainer.close()
    param = next(iter(jax.tree.leaves(trainer.learner.params)))
    print(json.dumps(dict(devices=jax.device_count(), history=history,
                          mesh_shape=None if trainer.mesh is None else dict(trainer.mesh.shape),
                          param_devices=len(param.sharding.device_set),
                          layers_per_gather=trainer.learner.model.config.fsdp_layers_per_gather)))


if __name__ == "__main__":
    main(*sys.argv[1:])
