"""The reward both sides of ``bench_grpo.py`` use (an alignkit ``module:function`` and a TRL reward function)."""

from __future__ import annotations

from typing import Any


def digit_fraction(prompts: list[Any], completions: list[str], **_: Any) -> list[float | None]:
    """The fraction of the completion's characters that are digits (0 for an empty one)."""
    return [sum(ch.isdigit() for ch in c) / len(c) if c else 0.0 for c in completions]
