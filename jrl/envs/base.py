"""The contract of an environment a model plays multi-turn episodes against, and its registry.

An :class:`Environment` starts one :class:`Episode` per completion row from the prompt's dataset row
(:meth:`Environment.reset`); after each model turn the runner (:mod:`jrl.envs.episodes`) calls
:meth:`Episode.step` with the turn's text and token ids, and the episode answers with a :class:`StepResult`: the
observation the model reads next (text, tokenized without special tokens, or token ids used as they are), this
turn's reward and whether the episode is over. An episode's reward is the sum of its turns' rewards: GRPO's
advantages are per sequence, so per-turn rewards reach them through that sum (a turn-level credit assignment is not
built).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

from jrl.registry import Registry


@dataclasses.dataclass(frozen=True)
class StepResult:
    """An environment's answer to one model turn."""

    observation: str | list[int] = ""
    """What the model reads before its next turn: text (tokenized without special tokens) or token ids. Ignored
    when ``done``."""
    reward: float = 0.0
    """This turn's reward (an episode's reward is the sum over its turns)."""
    done: bool = False
    """The episode is over (no further model turn)."""


@runtime_checkable
class Episode(Protocol):
    """One episode's state."""

    def step(self, text: str, token_ids: list[int]) -> StepResult:
        """The environment's answer to the model's turn (``text`` decoded from ``token_ids``, special tokens
        dropped)."""
        ...


@runtime_checkable
class Environment(Protocol):
    """Starts episodes; built once per run by its registered factory ``(env_config) -> Environment``."""

    def reset(self, row: dict) -> Episode:
        """A new episode for a prompt: ``row`` holds the prompt's dataset columns (one value each) and ``prompt``
        (the prompt text the model read)."""
        ...

    def prompt_tools(self) -> list[dict]:
        """The tools the model may call, as ``tokenizer.apply_chat_template(..., tools=...)`` takes them (the
        prompts declare them through the chat template); empty for an environment without tools."""
        ...


#: ``env.name`` → factory ``(EnvConfig) -> Environment``; the built-in ones register in :mod:`jrl.envs.builtin`.
ENVIRONMENTS = Registry("environment", "env.name",
                        how_to_register="@ENVIRONMENTS.register(name) on a factory (EnvConfig) -> Environment")


def prompt_tools(cfg) -> list[dict] | None:
    """The tools the prompts of a run with ``env`` section ``cfg`` declare (:meth:`Environment.prompt_tools`), or
    None: no environment, or one without tools."""
    if cfg.name is None:
        return None
    return ENVIRONMENTS.get(cfg.name)(cfg).prompt_tools() or None
