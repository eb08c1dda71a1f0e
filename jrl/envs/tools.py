"""Tools a model calls in a rollout: the call format, the registry and the built-in tools.

A tool call is the JSON object Qwen's and Llama-3.1's chat templates (the Hermes format) ask for, between tags::

    <tool_call>{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}</tool_call>

and its result goes back as ``<tool_response>...</tool_response>`` (:func:`tool_response`). A tool is a function of
its arguments that returns text; it registers in :data:`TOOLS` with the JSON schema of its arguments
(:func:`tool_schemas` gives them in the form ``tokenizer.apply_chat_template(..., tools=...)`` takes).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import operator
import re
from collections.abc import Callable

from jrl.registry import Registry

#: Tool name → :class:`Tool`.
TOOLS = Registry("tool", "env.tools", how_to_register="jrl.envs.tools.register_tool(name, schema)(fn)")

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Tool:
    """A registered tool: ``fn(**arguments) -> str`` and its arguments' JSON schema (``parameters``)."""

    name: str
    fn: Callable[..., str]
    description: str
    parameters: dict


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments, or ``error`` when the text between the tags is not a
    call (not JSON, no ``name``, arguments not an object)."""

    name: str | None
    arguments: dict
    error: str | None = None


def register_tool(name: str, parameters: dict, description: str = ""):
    """Decorator: register ``fn`` as tool ``name`` with the JSON schema ``parameters`` of its keyword arguments."""
    def deco(fn: Callable[..., str]) -> Callable[..., str]:
        TOOLS.register(name)(Tool(name, fn, description or (fn.__doc__ or "").strip().split("\n")[0], parameters))
        return fn

    return deco


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` in ``text``, in order (module docstring)."""
    calls = []
    for body in _CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(ToolCall(None, {}, f"not JSON: {e.msg}"))
            continue
        name, args = (obj.get("name"), obj.get("arguments", {})) if isinstance(obj, dict) else (None, None)
        if isinstance(args, str):  # some templates serialise the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(name, str) or not isinstance(args, dict):
            calls.append(ToolCall(None, {}, 'expected {"name": <string>, "arguments": <object>}'))
        else:
            calls.append(ToolCall(name, args))
    return calls


def run_tool_call(call: ToolCall, allowed: tuple[str, ...]) -> str:
    """The text a call returns: the tool's output, or an error message the model reads (unknown or not allowed
    tool, bad arguments, a tool that raised)."""
    if call.error:
        return f"error: {call.error}"
    if call.name not in allowed or call.name not in TOOLS:
        return f"error: unknown tool {call.name!r}; tools: {', '.join(allowed)}"
    try:
        return str(TOOLS.get(call.name).fn(**call.arguments))
    except TypeError as e:
        return f"error: bad arguments for {call.name}: {e}"
    except Exception as e:  # noqa: BLE001 - a tool's failure is an answer the model reads
        return f"error: {type(e).__name__}: {e}"


def tool_response(text: str) -> str:
    """A tool's result as the Hermes format hands it back."""
    return f"<tool_response>{text}</tool_response>"


def tool_schemas(names: tuple[str, ...]) -> list[dict]:
    """The named tools as ``apply_chat_template(tools=...)`` takes them (OpenAI function format)."""
    out = []
    for name in names:
        tool = TOOLS.get(name)
        out.append({"type": "function", "function": {"name": tool.name, "description": tool.description,
                                                     "parameters": tool.parameters}})
    return out


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_POWER = 1000


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_POWER:
            raise ValueError(f"exponent {right} is too large (at most {_MAX_POWER})")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")


@register_tool("calculator", {"type": "object", "properties": {"expression": {
    "type": "string", "description": "an arithmetic expression: numbers, + - * / // % ** and parentheses"}},
    "required": ["expression"]})
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses; nothing else)."""
    if len(expression) > 500:
        raise ValueError("expression longer than 500 characters")
    value = _evaluate(ast.parse(expression, mode="eval"))
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


@register_tool("python", {"type": "object", "properties": {"code": {
    "type": "string", "description": "Python code; what it prints is the result"}}, "required": ["code"]})
def python(code: str) -> str:
    """Run Python code in a sandbox (5 s, 512 MiB, no network, files only in a temporary directory); returns what
    it printed, or its error."""
    from jrl.envs.sandbox import run_python

    result = run_python(code)
    if result.timed_out:
        return f"error: timed out after {result.seconds:.1f} s"
    if result.returncode != 0:
        return "error: " + (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
    return result.stdout
