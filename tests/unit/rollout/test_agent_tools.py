"""Environment interface parts (issue 48, A): tool schemas from typed functions, the Hermes tool-call parser, and
every failure of a call (malformed, unknown tool, bad arguments, raising, past its time limit) answered as a tool
message with a counted status, never raised."""

from __future__ import annotations

import time

import pytest

from alignkit.errors import UnknownNameError
from alignkit.rollout.agents.calculator import CalculatorEnv, calculator
from alignkit.rollout.agents.env import ENVIRONMENTS, Environment, EnvState, register_environment
from alignkit.rollout.agents.parsers import TOOL_CALL_PARSERS, hermes
from alignkit.rollout.agents.tools import ToolCall, as_tool, call_tool


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def boom(x: str) -> str:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError("no luck")


def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke"


def test_schema_from_signature_and_docstring() -> None:
    s = as_tool(add).schema
    assert s["type"] == "function" and s["function"]["name"] == "add"
    assert s["function"]["description"] == "Add two integers."
    props = s["function"]["parameters"]["properties"]
    assert props["a"] == {"type": "integer", "description": "the first"}
    assert s["function"]["parameters"]["required"] == ["a"]


def test_hermes_parser() -> None:
    text = 'ok <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and ' \
           '<tool_call>{"name": "add", "arguments": "{\\"a\\": 5}"}</tool_call>'
    assert hermes(text) == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("add", {"a": 5})]
    assert hermes("no call here") == []
    assert TOOL_CALL_PARSERS.get("hermes") is hermes
    bad = hermes('<tool_call>{"name": add}</tool_call><tool_call>[1]</tool_call>'
                 '<tool_call>{"name": "x", "arguments": 3}</tool_call><tool_call>{"name": "y"')
    assert [c.error is not None for c in bad] == [True, True, True, True]
    assert bad[0].error.startswith("invalid JSON") and bad[3].error == "unclosed <tool_call>"


@pytest.mark.parametrize(("call", "status", "text"), [
    (ToolCall("add", {"a": 2, "b": 3}), "ok", "5"),
    (ToolCall("", error="invalid JSON: x"), "malformed", "Error: malformed tool call (invalid JSON: x)"),
    (ToolCall("mul", {"a": 1}), "unknown_tool", "Error: unknown tool 'mul'; available: ['add', 'boom', 'slow']"),
    (ToolCall("add", {"b": 1, "c": 2}), "bad_arguments",
     "Error: bad arguments for add: missing ['a'], unexpected ['c']"),
    (ToolCall("boom", {"x": "1"}), "error", "Error: boom raised RuntimeError: no luck"),
    (ToolCall("slow", {"seconds": 5}), "timeout", "Error: slow timed out after 0.2 s"),
])
def test_call_failures_become_messages(call: ToolCall, status: str, text: str) -> None:
    tools = {t.name: t for t in (as_tool(add), as_tool(boom), as_tool(slow, timeout_s=0.2))}
    began = time.perf_counter()
    result = call_tool(tools, call)
    assert (result.status, result.content) == (status, text)
    assert result.message() == {"role": "tool", "content": text}
    assert time.perf_counter() - began < 2.0  # the timeout answered at its limit, not after the tool's 5 s


def test_calculator_env_steps_and_counts() -> None:
    env = ENVIRONMENTS.get("calculator")()
    assert isinstance(env, CalculatorEnv) and calculator("12*(3+4)") == "84" and calculator("7/2") == "3.5"
    assert [s["function"]["name"] for s in env.schemas()] == ["calculator"]
    row = {"prompt": "What is 123*456?", "answer": "56088"}
    state = EnvState(row, env.reset(row))
    assert state.messages == [{"role": "user", "content": "What is 123*456?"}]
    r = env.step(state, '<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>')
    assert (r.messages, r.reward, r.done) == ([{"role": "tool", "content": "56088"}], 0.0, False)
    r = env.step(state, '<tool_call>{"name": "calculator", "arguments": {"expression": "import os"}}</tool_call>'
                        '<tool_call>{"name": "calc"}</tool_call><tool_call>oops</tool_call>')
    assert [m["content"].split(":")[0] for m in r.messages] == ["Error"] * 3 and not r.done
    assert state.counts == {"ok": 1, "error": 1, "unknown_tool": 1, "malformed": 1}
    assert env.step(state, "It is 56088") == type(r)([], 1.0, True)
    assert env.step(state, "56087").reward == 0.0 and env.step(state, "no idea").reward == 0.0


def test_environment_registry_names_the_closest() -> None:
    @register_environment("test_echo_env")
    class Echo(Environment):
        pass

    assert ENVIRONMENTS.get("test_echo_env") is Echo and Echo().schemas() is None
    with pytest.raises(UnknownNameError, match="calculator"):
        ENVIRONMENTS.get("calculater")


def untyped(text):  # type: ignore[no-untyped-def]
    """Reverse.

    Args:
        text: the string
    """
    return text[::-1]


def undocumented(text: str) -> str:
    return text


@pytest.mark.parametrize("fn, why", [(untyped, "missing a type hint"), (undocumented, "no docstring")])
def test_a_tool_without_hints_or_docstring_is_one_line(fn: object, why: str) -> None:
    """A plugin's tool whose schema cannot be read is refused at the environment's construction in one line naming
    the function and its file (it was transformers' exception and a traceback)."""
    from alignkit.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"agent tool '{fn.__name__}' \(.*test_agent_tools\.py:\d+\): .*{why}"):
        as_tool(fn)  # type: ignore[arg-type]
