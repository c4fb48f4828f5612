"""The shipped tool-use environment ``calculator``: a product of two numbers (``data/synth_agents.py`` rows:
``prompt``, ``answer``), a calculator tool, and a final reward of 1 when the answer's last number is the product
(0 otherwise; tool turns earn nothing).

``agent.env_args`` (the environment's settings): ``tool``: which tool is offered, ``calculator`` (the default:
``calculator(expression)``) or ``calc`` (the same as ``calc(x)``: a call the tiny tokenizer writes in 49 tokens
instead of 63, ``tool_call_text(..., tool="calc")``)."""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from typing import Any

from alignkit.errors import ConfigError
from alignkit.rollout.agents.env import EnvState, ToolEnvironment, register_environment

_OPS: dict[type, Callable[[Any, Any], Any]] = {ast.Add: operator.add, ast.Sub: operator.sub,
                                               ast.Mult: operator.mul, ast.Div: operator.truediv}
_NUMBER = re.compile(r"-?\d+")


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    raise ValueError("only numbers and + - * / are allowed")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / and parentheses, e.g. "347*829"
    """
    value = _eval(ast.parse(expression, mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def calc(x: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        x: numbers with + - * / and parentheses, e.g. "34*82"
    """
    return calculator(x)


#: ``agent.env_args.tool`` -> the function offered
TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator, "calc": calc}


@register_environment("calculator")
class CalculatorEnv(ToolEnvironment):
    """Answer ``row["prompt"]``; reward 1 when the final answer's last integer equals ``row["answer"]``."""

    row_fields = ("answer",)

    def functions(self) -> list[Callable[..., Any]]:
        unknown = sorted(set(self.settings) - {"tool"})
        if unknown:
            raise ConfigError(f"agent.env_args: unknown key(s) {unknown} for env calculator (valid: tool)")
        tool = self.settings.get("tool", "calculator")
        if tool not in TOOLS:
            raise ConfigError(f"agent.env_args.tool: expected one of {sorted(TOOLS)}, got {tool!r}")
        return [TOOLS[tool]]

    def final_reward(self, state: EnvState, text: str) -> float:
        numbers = _NUMBER.findall(text)
        return float(bool(numbers) and numbers[-1] == str(state.row["answer"]).strip())
