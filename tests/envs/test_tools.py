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


#: A ChatML template that declares tools the way Qwen's does (a system block listing each tool's JSON schema).
TOOLS_TEMPLATE = ("{%- if tools -%}{{- '<|im_start|>system\\n# Tools\\n<tools>' -}}{%- for t in tools -%}"
                  "{{- '\\n' ~ (t | tojson) -}}{%- endfor -%}{{- '\\n</tools>' ~ eos_token ~ '\\n' -}}{%- endif -%}"
                  "{%- for m in messages -%}{{- '<|im_start|>' ~ m['role'] ~ '\\n' ~ m['content'] ~ eos_token ~ '\\n' -}}"
                  "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def test_a_tools_run_declares_its_tools_in_every_prompt(tmp_path):
    """The ``tools`` environment's tools reach the chat template (``tools=``) of every training and held-out prompt;
    ``higher_lower`` declares none."""
    import json
    import shutil
    from pathlib import Path

    from jrl.data.config import DataConfig
    from jrl.envs import prompt_tools
    from jrl.train.config import ModelSpec, TrainConfig
    from jrl.train.evaluation import EvalConfig
    from jrl.train.trainer import Trainer

    model_dir = tmp_path / "model"
    shutil.copytree(Path(__file__).resolve().parents[2] / "models" / "tiny-arithmetic", model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOLS_TEMPLATE}))
    env = EnvConfig(name="tools", tools=("calculator", "python"))
    cfg = TrainConfig(model=ModelSpec(path=str(model_dir)), rewards=(), env=env, output_dir=str(tmp_path / "run"),
                      eval_every=1, eval=EvalConfig(holdout=4), data=DataConfig(max_prompt_length=1024, max_examples=16))
    trainer = Trainer(cfg, progress=False)
    texts = trainer.loader.dataset.prompt_texts + trainer.evaluator.prompts.prompt_texts
    assert len(texts) > 4
    for text in texts:
        assert text.startswith("<|im_start|>system\n# Tools\n<tools>")
        assert '"name": "calculator"' in text and '"name": "python"' in text and '"expression"' in text
    assert prompt_tools(EnvConfig(name="higher_lower")) is None and prompt_tools(EnvConfig()) is None


def test_a_template_that_ignores_tools_is_warned_about(caplog):
    import logging

    from jrl.data.config import DataConfig
    from jrl.data.pipeline import build_prompt_dataset
    from jrl.data.tokenizer import load_byte_tokenizer

    tools = tool_schemas(("calculator",))
    with caplog.at_level(logging.WARNING, logger="jrl.data.pipeline"):
        data = build_prompt_dataset(DataConfig(max_examples=4), load_byte_tokenizer(), tools=tools)
    assert data.prompt_texts == build_prompt_dataset(DataConfig(max_examples=4), load_byte_tokenizer()).prompt_texts
    warnings = [r.getMessage() for r in caplog.records if "tools" in r.getMessage()]
    assert len(warnings) == 1 and "['calculator']" in warnings[0] and "ignores tools=" in warnings[0]
    assert "data.system_prompt" in warnings[0]
