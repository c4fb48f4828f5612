"""The environment interface of multi-turn rollouts (``agent.env`` names one; a plugin registers its own with
:func:`register_environment`, imported through the config's ``plugins:``).

An environment is built once per run from the ``agent:`` section and keeps nothing of a trajectory on itself:
``reset(row) -> messages`` opens a conversation from a prompt row (the row's ``prompt`` and its other fields), and
``step(state, assistant_message) -> StepResult(messages, reward, done)`` answers one policy turn; ``state`` (an
:class:`EnvState`) is the trajectory's: the row, the conversation so far, the turn index, a dict for the
environment's own use and the tool-call counts. :class:`ToolEnvironment` is the usual shape: its ``tools``
(typed Python functions) answer the turn's tool calls; a turn without a call is the final answer, scored by
``final_reward``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from alignkit.registry import Registry
from alignkit.rollout.agents.parsers import TOOL_CALL_PARSERS
from alignkit.rollout.agents.tools import Tool, as_tool, call_tool

Message = dict[str, Any]


@dataclass
class EnvState:
    """One trajectory's state: its prompt ``row`` (``prompt`` + fields), the ``messages`` so far (the policy's turns
    as the text it wrote), the ``turn`` (policy turns taken), ``data`` for the environment's own use and ``counts``
    of tool calls by status (``ok``, ``malformed``, ``unknown_tool``, ...; summed into the rollout's metrics)."""

    row: dict[str, Any]
    messages: list[Message]
    turn: int = 0
    data: dict[str, Any] = field(default_factory=dict)
    counts: Counter = field(default_factory=Counter)


@dataclass(frozen=True)
class StepResult:
    """What a policy turn led to: the environment's new ``messages`` (tool results, a user's reply), the turn's
    ``reward`` and whether the trajectory is ``done`` (its last reward is the final one)."""

    messages: list[Message]
    reward: float
    done: bool


class Environment:
    """The base of every environment: ``tools`` (schemas go to the chat template's ``tools=``), ``reset`` and
    ``step``. ``settings``: keyword settings of a subclass's own (the run builds it with none; a plugin's class
    fixes its own)."""

    #: the prompt-row fields ``reset`` / ``step`` read besides the prompt (e.g. ``("answer",)``): a row without one
    #: is refused when the data set is read, one line naming the file and row, before any rollout
    row_fields: tuple[str, ...] = ()

    def __init__(self, settings: dict[str, Any] | None = None, *, tool_timeout_s: float = 5.0,
                 tool_call_parser: str = "hermes") -> None:
        self.settings = dict(settings or {})
        self.tools: dict[str, Tool] = {t.name: t for t in (as_tool(fn, tool_timeout_s) for fn in self.functions())}
        self.parse = TOOL_CALL_PARSERS.get(tool_call_parser)

    def functions(self) -> list[Callable[..., Any]]:
        """The typed Python functions offered as tools (none by default)."""
        return []

    def schemas(self) -> list[dict[str, Any]] | None:
        """The tools' JSON schemas for ``apply_chat_template(tools=...)``; None without tools."""
        return [t.schema for t in self.tools.values()] or None

    def reset(self, row: dict[str, Any]) -> list[Message]:
        """The conversation a trajectory opens with (default: the row's prompt as the user's message)."""
        prompt = row["prompt"]
        return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]

    def step(self, state: EnvState, assistant_message: str) -> StepResult:
        raise NotImplementedError


class ToolEnvironment(Environment):
    """A turn with tool calls is answered by one tool message per call (reward 0, not done); a turn without one is
    the final answer: ``final_reward(state, text)``, done."""

    def step(self, state: EnvState, assistant_message: str) -> StepResult:
        calls = self.parse(assistant_message)
        if not calls:
            return StepResult([], self.final_reward(state, assistant_message), True)
        results = [call_tool(self.tools, c) for c in calls]
        state.counts.update(r.status for r in results)
        return StepResult([r.message() for r in results], self.turn_reward(state, results), False)

    def turn_reward(self, state: EnvState, results: list[Any]) -> float:
        """The reward of a tool turn (0 by default: only the answer is scored)."""
        return 0.0

    def final_reward(self, state: EnvState, text: str) -> float:
        raise NotImplementedError


ENVIRONMENTS: Registry[type[Environment]] = Registry("environment")


def register_environment(name: str) -> Callable[[type[Environment]], type[Environment]]:
    """Class decorator: ``@register_environment("mine")`` makes ``agent.env: mine`` build it."""
    return ENVIRONMENTS.register(name)
