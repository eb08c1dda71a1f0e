"""Child process for test_async_rollout.py: a prefetching GRPO run on 2 fake CPU devices (XLA_FLAGS set by
the parent), where the embedded sampler and the update take turns on both devices (ROLLOUT_DEVICES 0), or the
sampler has device 1 to itself and the learner device 0 (ROLLOUT_DEVICES 1); PARTIAL 1 makes the rollouts
partial (paged sampler, rows carried between steps, max_staleness 2). LOOK_AHEAD 0 runs every step with
``Trainer.train_step(look_ahead=False)`` (the next step's experience is not made during an update).

argv: MODEL_DIR OUT_DIR REWARD_FILE ROLLOUT_DEVICES PARTIAL [LOOK_AHEAD]. Prints one JSON line with what the parent
asserts. ``stop`` as LOOK_AHEAD: ``Trainer.train`` with the rewards scored in this process (a reward file that sends
SIGTERM stops it), then resumed from its checkpoint in a new trainer; the steps each logged.
"""

import dataclasses
import json
import sys
from pathlib import Path

import jax

from jrl.data.pipeline import DataConfig
from jrl.losses import GRPOConfig
from jrl.rollout.kv_config import KVCacheConfig
from jrl.sharding import MeshConfig
from jrl.train.config import ModelSpec, OptimConfig, RolloutConfig, ScoringConfig, TrainConfig
from jrl.train.trainer import Trainer, train
from jrl.rewards.functions import RewardSpec


def main(model_dir, out_dir, reward_file, rollout_devices, partial, look_ahead="1"):
    rollout = RolloutConfig(max_new_tokens=6, prefetch_depth=1, max_staleness=1, devices=int(rollout_devices))
    if int(partial):
        rollout = dataclasses.replace(rollout, partial=True, max_staleness=2, max_new_tokens=12,
                                      kv=KVCacheConfig(layout="paged", page_size=4, round_steps=4, slots=8),
                                      stop_token_ids=tuple(range(3, 30)))
    stop = look_ahead == "stop"
    cfg = TrainConfig(
        model=ModelSpec(path=model_dir), mesh=MeshConfig(fsdp=-1),
        data=DataConfig(prompts_per_batch=2, max_prompt_length=64, seed=1), rollout=rollout,
        rewards=(RewardSpec(path=f"{reward_file}:low_ids"),), algo=GRPOConfig(num_generations=2),
        optim=OptimConfig(learning_rate=1e-2, micro_batch_size=2), output_dir=out_dir, max_steps=3, save_every=0,
        scoring=ScoringConfig(num_workers=0 if stop else ScoringConfig.num_workers))
    if stop:
        first = train(cfg, progress=False)
        resumed = train(dataclasses.replace(cfg, resume=True), progress=False)
        print(json.dumps(dict(first=first, resumed=resumed, checkpoints=sorted(
            int(p.name) for p in (Path(out_dir) / "checkpoints").iterdir() if p.name.isdigit()))))
        return
    trainer = Trainer(cfg, progress=False)
    ahead = bool(int(look_ahead))
    first = trainer.train_step(ahead)  # (not written to metrics.jsonl: train() logs the steps it runs)
    turns = type(trainer.source.device_lock).__name__
    engine = trainer.engine
    sampler_devices = sorted({d.id for x in jax.tree.leaves(engine._state) for d in x.sharding.device_set})
    learner_devices = sorted({d.id for x in jax.tree.leaves(trainer.learner.params) for d in x.sharding.device_set})
    history = [first] + (trainer.train() if ahead else [trainer.train_step(False) for _ in range(cfg.max_steps - 1)])
    trainer.close()
    print(json.dumps(dict(devices=jax.device_count(), history=history, device_lock=turns,
                          sampler_devices=sampler_devices, learner_devices=learner_devices)))


if __name__ == "__main__":
    main(*sys.argv[1:])
