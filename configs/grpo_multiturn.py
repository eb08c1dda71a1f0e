"""Multi-turn GRPO: the default run (configs/grpo.py) with episodes instead of single answers. The shipped tiny
model answers the built-in arithmetic questions and, after a wrong answer, reads ``higher`` or ``lower`` and answers
again (up to 3 turns; reward 1, 0.5, 0.25 for a right answer at the first, second, third turn). Offline on CPU.

The loss is normalised per episode (``loss_type="grpo"``), not per token as the default run's ``dapo``: a failed
episode plays every turn and has several times the tokens of one answered at once, so per-token normalisation lets
the failures' negative advantages outweigh the successes' (measured: the policy's entropy doubled over 300 steps
with ``dapo`` and stayed flat with ``grpo``; benchmarks/RESULTS.md).

    python scripts/train.py --config configs/grpo_multiturn.py
"""

from __future__ import annotations

import dataclasses
import runpy
from pathlib import Path

from jrl.envs.config import EnvConfig
from jrl.train.config import TrainConfig


def config() -> TrainConfig:
    grpo = runpy.run_path(str(Path(__file__).with_name("grpo.py")))["config"]()
    return dataclasses.replace(grpo, rewards=(), env=EnvConfig(name="higher_lower", max_turns=3, max_episode_tokens=96),
                               algo=dataclasses.replace(grpo.algo, loss_type="grpo"), output_dir="runs/grpo_multiturn")
