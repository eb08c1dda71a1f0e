"""Tool calls (jrl.envs.tools): the Hermes ``<tool_call>`` JSON format parsed with its errors named, the calculator
evaluates arithmetic and nothing else, a call's failure is an answer the model reads, and the ``tools`` environment
runs a turn's calls and scores the final answer."""

from __future__ import annotations

import pytest

from jrl.envs import ENVIRONMENTS, EnvConfig, parse_tool_calls
from jrl.envs.builtin import read_answer
from jrl.envs.tools import TOOLS, ToolCall, calculator, run_tool_call, tool_schemas


def test_calls_are_parsed_in_order_with_their_errors():
    text = ('I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
            '<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n</tool_call>'
            '<tool_call>{not json}</tool_call><tool_call>{"arguments": {}}</tool_call>')
    calls = parse_tool_calls(text)
    assert calls[0] == ToolCall("calculator", {"expression": "2+3"})
    assert calls[1] == ToolCall("python", {"code": "print(1)"})  # arguments serialised as a string
    assert calls[2].name is None and calls[2].error.startswith("not JSON")
    assert calls[3].name is None and "name" in calls[3].error
    assert parse_tool_calls("no calls here") == []


@pytest.mark.parametrize("expression, value", [("2+3*4", "14"), ("(7-10)//2", "-2"), ("2**10", "1024"),
                                               ("7/2", "3.5"), ("-3 % 5", "2"), ("1.5*2", "3")])
def test_calculator_evaluates_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os').system('ls')", "x + 1", "(1).__class__", "[1, 2]",
                                        "2 ** 100000", "'a' * 3"])
def test_calculator_refuses_anything_else(expression):
    with pytest.raises(ValueError):
        calculator(expression)


def test_a_failing_call_is_an_answer_the_model_reads():
    allowed = ("calculator",)
    assert run_tool_call(ToolCall("calculator", {"expression": "6*7"}), allowed) == "42"
    assert run_tool_call(ToolCall("python", {"code": "1"}), allowed).startswith("error: unknown tool 'python'")
    assert run_tool_call(ToolCall("calculator", {"expr": "1"}), allowed).startswith("error: bad arguments")
    assert run_tool_call(ToolCall("calculator", {"expression": "1/0"}), allowed) == \
        "error: ZeroDivisionError: division by zero"
    assert run_tool_call(ToolCall(None, {}, "not JSON: x"), allowed) == "error: not JSON: x"


def test_schemas_for_chat_templates():
    (schema,) = tool_schemas(("calculator",))
    assert schema["type"] == "function" and schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]
    assert "calculator" in TOOLS and "python" in TOOLS


def test_the_tools_environment_runs_calls_then_scores_the_answer():
    env = ENVIRONMENTS.get("tools")(EnvConfig(name="tools", tools=("calculator",)))
    episode = env.reset({"answer": 42, "prompt": "What is 6*7?"})
    first = episode.step('<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>', [])
    assert first.observation == "<tool_response>42</tool_response>" and not first.done and first.reward == 0
    last = episode.step("<answer>42</answer>", [])
    assert last.done and last.reward == 1.0
    assert env.reset({"answer": 42}).step("41", []).reward == 0.0
    with pytest.raises(KeyError, match="unknown tool 'nope'"):
        ENVIRONMENTS.get("tools")(EnvConfig(name="tools", tools=("nope",)))


def test_higher_lower_hints_and_decays():
    episode = ENVIRONMENTS.get("higher_lower")(EnvConfig(name="higher_lower")).reset({"answer": 12})
    assert episode.step("<answer>9</answer>", []).observation == " higher\n"
    assert episode.step("I think 15", []).observation == " lower\n"
    assert episode.step("no idea", []).observation == " no answer\n"
    done = episode.step("<answer>12</answer>", [])
    assert done.done and done.reward == 0.5 ** 3
    assert read_answer("<answer> -3 </answer> or 7") == -3 and read_answer("7 then 8") == 8 and read_answer("") is None
