"""The training loop composed of parts (a batch source from :mod:`jrl.sources`, an algorithm, the learner), the
algorithms (GRPO, EBFT), policy loading, checkpointing, evaluation, logging, and the explorer/trainer split.

Names are imported lazily: importing the package imports none of the trainer's modules.
"""

from jrl._lazy import lazy_exports

_EXPORTS = {
    "TrainConfig": "jrl.train.config",
    "ModelSpec": "jrl.train.config",
    "RolloutConfig": "jrl.rollout.config",
    "OptimConfig": "jrl.train.optim_config",
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
    "RewardSpec": "jrl.rewards.functions",
}

__all__, __getattr__, __dir__ = lazy_exports("jrl.train", _EXPORTS)
