"""Tool-call parsers by model family (``agent.tool_call_parser``): an assistant message's text -> its calls.
``hermes`` (Hermes, Qwen2.5 / Qwen3): each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
A call that cannot be read is returned as a :class:`ToolCall` with ``error`` set, so the environment answers it."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from alignkit.registry import Registry
from alignkit.rollout.agents.tools import ToolCall

ToolCallParser = Callable[[str], list[ToolCall]]
TOOL_CALL_PARSERS: Registry[ToolCallParser] = Registry("tool-call parser")

_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@TOOL_CALL_PARSERS.register("hermes")
def hermes(text: str) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` of ``text`` in order; an unclosed one, invalid JSON, a missing name or
    non-object arguments are malformed calls."""
    calls = []
    for m in _HERMES.finditer(text):
        body, closed = m.group(1).strip(), bool(m.group(2))
        calls.append(_read(body) if closed else ToolCall("", error="unclosed <tool_call>"))
    return calls


def _read(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall("", error=f"invalid JSON: {e.msg}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", error="expected an object with a string 'name'")
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error="'arguments' must be an object")
    return ToolCall(obj["name"], args)
