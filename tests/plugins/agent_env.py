"""A tool-using environment registered from OUTSIDE the package, in one file (docs/workflows/agents.md shows it):
the user asks for a word's letters reversed, a ``reverse`` tool does it, the answer is scored by exact match.

Use: ``plugins: [tests.plugins.agent_env]``, ``algorithm: grpo_agent``, ``agent.env: reverse_word`` and prompt rows
``{"prompt": "Reverse: cat", "answer": "tac"}``.
"""

from __future__ import annotations

from alignkit.rollout.agents.env import EnvState, ToolEnvironment, register_environment


def reverse(text: str) -> str:
    """Reverse a string.

    Args:
        text: the string to reverse
    """
    return text[::-1]


@register_environment("reverse_word")
class ReverseWord(ToolEnvironment):
    row_fields = ("answer",)  # a row without it is refused as the data is read

    def functions(self) -> list:
        return [reverse]

    def final_reward(self, state: EnvState, text: str) -> float:
        return float(text.strip() == state.row["answer"])
