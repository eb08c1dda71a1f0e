"""Child process for test_async_rollout.py: a prefetching GRPO run on 2 fake CPU devices (XLA_FLAGS set by
the parent), where the embedded sampler and the update take turns on both devices (ROLLOUT_DEVICES 0), or the
sampler has device 1 to itself and the learner device 0 (ROLLOUT_DEVICES 1); PARTIAL 1 makes the rollouts
partial (paged sampler, rows carried between steps, max_staleness 2).

argv: MODEL_DIR OUT_DIR REWARD_FILE ROLLOUT_DEVICES PARTIAL. Prints one JSON line with what the parent asserts.
"""

import dataclasses
import json
import sys

import jax

from jrl.data.pipeline import DataConfig
from jrl.losses import GRPOConfig
from jrl.rollout.kv_config import KVCacheConfig
from jrl.sharding import MeshConfig
from jrl.train.config import ModelSpec, OptimConfig, RolloutConfig, TrainConfig
from jrl.train.trainer import Trainer
from jrl.rewards.functions import RewardSpec


def main(model_dir, out_dir, reward_file, rollout_devices, partial):
    rollout = RolloutConfig(max_new_tokens=6, prefetch_depth=1, max_staleness=1, devices=int(rollout_devices))
    if int(partial):
        rollout = dataclasses.replace(rollout, partial=True, max_staleness=2, max_new_tokens=12,
                                      kv=KVCacheConfig(layout="paged", page_size=4, round_steps=4, slots=8),
                                      stop_token_ids=tuple(range(3, 30)))
    cfg = TrainConfig(
        model=ModelSpec(path=model_dir), mesh=MeshConfig(fsdp=-1),
        data=DataConfig(prompts_per_batch=2, max_prompt_length=64, seed=1), rollout=rollout,
        rewards=(RewardSpec(path=f"{reward_file}:low_ids"),), algo=GRPOConfig(num_generations=2),
        optim=OptimConfig(learning_rate=1e-2, micro_batch_size=2), output_dir=out_dir, max_steps=3, save_every=0)
    trainer = Trainer(cfg, progress=False)
    first = trainer.train_step()  # (not written to metrics.jsonl: train() logs the steps it runs)
    turns = type(trainer.source.device_lock).__name__
    engine = trainer.engine
    sampler_devices = sorted({d.id for x in jax.tree.leaves(engine._state) for d in x.sharding.device_set})
    learner_devices = sorted({d.id for x in jax.tree.leaves(trainer.learner.params) for d in x.sharding.device_set})
    history = [first] + trainer.train()
    trainer.close()
    print(json.dumps(dict(devices=jax.device_count(), history=history, device_lock=turns,
                          sampler_devices=sampler_devices, learner_devices=learner_devices)))


if __name__ == "__main__":
    main(*sys.argv[1:])
