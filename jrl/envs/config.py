"""The ``env`` section of a :class:`~jrl.train.TrainConfig`: multi-turn episodes against an environment instead of
one completion per prompt (:mod:`jrl.envs`)."""

from __future__ import annotations

import dataclasses

from jrl.validation import check_int, check_real, invalid


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """Which environment answers the model's turns, and how long an episode may run."""

    name: str | None = None
    """An ``ENVIRONMENTS`` name (``guess``: a higher/lower number game; ``tools``: the model may call the tools of
    ``tools`` and its last turn is scored against the dataset's ``answer`` column), or None for single-turn
    rollouts (one completion per prompt, scored by the reward functions)."""
    max_turns: int = 4
    """Model turns per episode at most (each at most ``rollout.max_new_tokens`` tokens)."""
    max_episode_tokens: int = 256
    """Completion tokens per episode at most, the model's and the environment's together (the trained sequence is
    the prompt plus these); an episode that reaches it ends, marked truncated."""
    step_timeout_s: float = 10.0
    """Seconds one environment step may take; a step that takes longer, raises or returns something that is not a
    step result ends its episode with no reward (NaN) and is counted in ``env/errors/<kind>``."""
    tools: tuple[str, ...] = ("calculator",)
    """Tools the ``tools`` environment runs (``TOOLS`` names: ``calculator``, ``python``)."""
    observation_role: str | None = None
    """None: an observation's text follows the model's turn as is; a role (``user``, ``tool``): it is wrapped as that
    role's message by the tokenizer's chat template, with the next assistant turn's generation prompt after it
    (:mod:`jrl.envs.chat`), so episodes read as the template renders a conversation."""
    reuse_kv_cache: bool = True
    """Continue an episode on the KV cache of its previous turns where the engine can (the embedded sampler: only
    the observation is prefilled); False, or an engine that cannot (vLLM), prefills the whole conversation at every
    turn."""
    reward_weight: float = 1.0
    """Weight of the episode's reward (the sum of its turns' rewards) among the run's rewards: it is one more
    reward column, ``env/<name>``, beside the reward functions'."""

    def __post_init__(self):
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise invalid("EnvConfig", "name", self.name, "use an ENVIRONMENTS name or None")
        check_int(self, "max_turns", lo=1)
        check_int(self, "max_episode_tokens", lo=1)
        check_real(self, "step_timeout_s", gt=0.0, fix="use a number of seconds > 0")
        check_real(self, "reward_weight", fix="use a finite number")
        object.__setattr__(self, "tools", tuple(self.tools))
        if self.observation_role is not None and (not isinstance(self.observation_role, str)
                                                  or not self.observation_role):
            raise invalid("EnvConfig", "observation_role", self.observation_role, "use a chat role or None")
