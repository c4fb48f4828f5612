"""Tools as typed Python functions: the JSON schema a chat template's ``tools=`` takes is read off the signature
and the docstring (``transformers.utils.get_json_schema``), and a call never crashes the run: a malformed call, an
unknown tool, bad arguments, a tool that raises or runs past its time limit each become a tool message saying so,
with a status the rollout counts (``agent/tool_<status>``)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

from alignkit.errors import ConfigError

#: what a tool call came to: ``ok`` or why not
STATUSES = ("ok", "malformed", "unknown_tool", "bad_arguments", "error", "timeout")


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's ``name`` and its keyword ``arguments``; ``error`` (then ``name`` may be empty):
    why the text could not be read as a call (a malformed call is still a call, answered with the reason)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """A call's answer: the tool message's ``content`` and its ``status`` (one of :data:`STATUSES`)."""

    content: str
    status: str

    def message(self) -> dict[str, str]:
        """The tool message the chat template renders."""
        return {"role": "tool", "content": self.content}


@dataclass(frozen=True)
class Tool:
    """A typed Python function offered to the policy: ``schema`` (OpenAI function format, from the signature and
    the Google-style docstring) and ``timeout_s`` (a call running longer answers with a timeout)."""

    fn: Callable[..., Any]
    schema: dict[str, Any]
    timeout_s: float

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


def as_tool(fn: Callable[..., Any], timeout_s: float = 5.0) -> Tool:
    """``fn`` as a :class:`Tool`; its every argument needs a type hint and a line in the docstring's ``Args:``
    (otherwise one line naming the function and its file, at the environment's construction, not mid-run)."""
    try:
        schema = get_json_schema(fn)
    except (TypeHintParsingException, DocstringParsingException) as e:
        code = getattr(fn, "__code__", None)
        where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
        raise ConfigError(f"agent tool {getattr(fn, '__qualname__', fn)!r}{where}: {e}; a tool needs a type hint "
                          "on every argument and a Google-style docstring with an Args: line for each") from None
    return Tool(fn, schema, timeout_s)


def call_tool(tools: dict[str, Tool], call: ToolCall) -> ToolResult:
    """Run ``call`` against ``tools`` (by name): its result as text (JSON for what is not a string), or a message
    saying why not. A call past its tool's ``timeout_s`` is answered at the limit; its thread is left to finish on
    its own (a Python thread cannot be killed), so a tool that may hang should watch its own clock too."""
    if call.error is not None:
        return ToolResult(f"Error: malformed tool call ({call.error})", "malformed")
    tool = tools.get(call.name)
    if tool is None:
        return ToolResult(f"Error: unknown tool {call.name!r}; available: {sorted(tools)}", "unknown_tool")
    params = tool.schema["function"].get("parameters", {})
    missing = [p for p in params.get("required", []) if p not in call.arguments]
    extra = [a for a in call.arguments if a not in params.get("properties", {})]
    if missing or extra:
        return ToolResult(f"Error: bad arguments for {call.name}: missing {missing}, unexpected {extra}",
                          "bad_arguments")
    return _run_with_limit(tool, call.arguments)


def _run_with_limit(tool: Tool, arguments: dict[str, Any]) -> ToolResult:
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = tool.fn(**arguments)
        except Exception as e:  # noqa: BLE001 - a tool's failure is the policy's observation, never the run's crash
            out["error"] = f"{type(e).__name__}: {e}"

    worker = threading.Thread(target=target, daemon=True, name=f"tool-{tool.name}")
    worker.start()
    worker.join(tool.timeout_s)
    if worker.is_alive():
        return ToolResult(f"Error: {tool.name} timed out after {tool.timeout_s:g} s", "timeout")
    if "error" in out:
        return ToolResult(f"Error: {tool.name} raised {out['error']}", "error")
    value = out.get("value")
    return ToolResult(value if isinstance(value, str) else json.dumps(value), "ok")
