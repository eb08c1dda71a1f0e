"""The training loop composed of parts (rollout source, algorithm, learner), the algorithms (GRPO, EBFT),
rollout producer, reward runner, checkpointing and logging.

Names are imported lazily, so a reward worker process that imports :mod:`jrl.train.rewards` does not
import the models, losses or the trainer.
"""

from jrl._lazy import lazy_exports

_EXPORTS = {
    "TrainConfig": "jrl.train.config",
    "ModelSpec": "jrl.train.config",
    "RolloutConfig": "jrl.rollout.config",
    "OptimConfig": "jrl.train.config",
    "ScoringConfig": "jrl.train.config",
    "EvalConfig": "jrl.train.evaluation",
    "load_config_file": "jrl.train.config",
    "EBFTConfig": "jrl.train.ebft_config",
    "ALGORITHMS": "jrl.train.algorithms",
    "Learner": "jrl.train.learner",
    "LossTerm": "jrl.train.learner",
    "StepBatch": "jrl.train.algorithms.grpo",
    "Trainer": "jrl.train.trainer",
    "train": "jrl.train.trainer",
    "TrainCheckpointer": "jrl.train.checkpoint",
    "export_checkpoint": "jrl.train.export",
    "RewardSpec": "jrl.train.rewards",
}

__all__, __getattr__, __dir__ = lazy_exports("jrl.train", _EXPORTS)
