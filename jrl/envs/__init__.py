"""Environments a model plays multi-turn episodes against (the ``env`` section of a run): the protocol and its
registry (:mod:`jrl.envs.base`), the episode runner on any rollout engine (:mod:`jrl.envs.episodes`), tools and their
call format (:mod:`jrl.envs.tools`), a sandbox for model-written Python (:mod:`jrl.envs.sandbox`) and the built-in
environments (:mod:`jrl.envs.builtin`, registered on import)."""

from jrl.envs import builtin  # noqa: F401  (registers the built-in environments)
from jrl.envs.base import ENVIRONMENTS, Environment, Episode, StepResult, prompt_tools
from jrl.envs.config import EnvConfig
from jrl.envs.episodes import EnvSteps, EpisodeRollout, join_episodes, run_episodes
from jrl.envs.tools import TOOLS, ToolCall, parse_tool_calls, register_tool

__all__ = ["ENVIRONMENTS", "TOOLS", "EnvConfig", "EnvSteps", "Environment", "Episode", "EpisodeRollout", "StepResult",
           "ToolCall", "join_episodes", "prompt_tools", "parse_tool_calls", "register_tool", "run_episodes"]
