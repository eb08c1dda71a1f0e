"""The built-in environments: ``higher_lower`` (answer again after a hint) and ``tools`` (call tools, then answer).

Both read the prompt's ``answer`` column (the built-in arithmetic task has it) and a model's answer as the first
``<answer>N</answer>`` of its turn (the arithmetic task's format), or else the last integer in the turn.
"""

from __future__ import annotations

import dataclasses
import re

from jrl.envs.base import ENVIRONMENTS, StepResult
from jrl.envs.config import EnvConfig
from jrl.envs.tools import TOOLS, parse_tool_calls, run_tool_call, tool_response, tool_schemas

_TAGGED = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
_NUMBER = re.compile(r"-?\d+")


def read_answer(text: str) -> int | None:
    """The integer a turn answers: the first ``<answer>N</answer>``, else the last integer, else None."""
    tagged = _TAGGED.search(text)
    if tagged:
        return int(tagged.group(1))
    numbers = _NUMBER.findall(text)
    return int(numbers[-1]) if numbers else None


def _target(row: dict) -> int:
    if "answer" not in row:
        raise KeyError(f"the environment needs an 'answer' column in the prompt dataset; its columns: "
                       f"{sorted(row)}")
    return int(row["answer"])


@dataclasses.dataclass
class HigherLowerEpisode:
    """One game: after a wrong answer the model reads ``higher`` or ``lower`` and answers again; a right answer at
    turn ``k`` (from 0) ends the episode with reward ``decay ** k``."""

    target: int
    decay: float
    turn: int = 0

    def step(self, text: str, token_ids: list[int]) -> StepResult:
        guess, self.turn = read_answer(text), self.turn + 1
        if guess == self.target:
            return StepResult(reward=self.decay ** (self.turn - 1), done=True)
        hint = "no answer" if guess is None else "higher" if guess < self.target else "lower"
        return StepResult(observation=f" {hint}\n")


@dataclasses.dataclass(frozen=True)
class HigherLower:
    """The ``higher_lower`` environment (:class:`HigherLowerEpisode`); ``decay`` 0.5 per extra turn."""

    decay: float = 0.5

    def reset(self, row: dict) -> HigherLowerEpisode:
        return HigherLowerEpisode(_target(row), self.decay)

    def prompt_tools(self) -> list[dict]:
        return []


@dataclasses.dataclass
class ToolEpisode:
    """A tool-use episode: each tool call of a turn runs and its result comes back as ``<tool_response>``; a turn
    without a call is the final answer, rewarded 1.0 if it equals the ``answer`` column."""

    target: int
    tools: tuple[str, ...]

    def step(self, text: str, token_ids: list[int]) -> StepResult:
        calls = parse_tool_calls(text)
        if not calls:
            return StepResult(reward=float(read_answer(text) == self.target), done=True)
        return StepResult(observation="".join(tool_response(run_tool_call(c, self.tools)) for c in calls))


@dataclasses.dataclass(frozen=True)
class ToolUse:
    """The ``tools`` environment (:class:`ToolEpisode`) with the tools of ``env.tools``."""

    tools: tuple[str, ...]

    def reset(self, row: dict) -> ToolEpisode:
        return ToolEpisode(_target(row), self.tools)

    def prompt_tools(self) -> list[dict]:
        return tool_schemas(self.tools)


@ENVIRONMENTS.register("higher_lower")
def higher_lower(cfg: EnvConfig) -> HigherLower:
    return HigherLower()


@ENVIRONMENTS.register("tools")
def tool_use(cfg: EnvConfig) -> ToolUse:
    for name in cfg.tools:
        TOOLS.get(name)  # an unknown tool fails here, naming the registered ones
    return ToolUse(cfg.tools)
