"""Trainer loops (GRPO, EBFT), rollout producer, reward runner, checkpointing and logging.

Names are imported lazily, so a reward worker process that imports :mod:`jrl.train.rewards` does not
import the models, losses or the trainer.
"""

from jrl._lazy import lazy_exports

_EXPORTS = {
    "TrainConfig": "jrl.train.config",
    "ModelSpec": "jrl.train.config",
    "RolloutConfig": "jrl.train.config",
    "OptimConfig": "jrl.train.config",
    "load_config_file": "jrl.train.config",
    "EBFTConfig": "jrl.train.ebft_config",
    "EBFTStructuredTrainer": "jrl.train.ebft",
    "EBFTStridedTrainer": "jrl.train.ebft_strided",
    "GRPOLearner": "jrl.train.step",
    "StepBatch": "jrl.train.step",
    "GRPOTrainer": "jrl.train.grpo",
    "train": "jrl.train.grpo",
    "TrainCheckpointer": "jrl.train.checkpoint",
    "export_checkpoint": "jrl.train.export",
    "RewardSpec": "jrl.train.rewards",
}

__all__, __getattr__, __dir__ = lazy_exports("jrl.train", _EXPORTS)
