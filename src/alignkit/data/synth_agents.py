"""Synthetic data of the shipped tool-use task (``agent.env: calculator``): products of two 3-digit numbers (``digits``
of them), which the tiny policy cannot compute alone but can get from a ``calculator`` tool (``tool="calc"``: the
short call ``{"name":"calc","arguments":{"x":"34*82"}}`` of ``agent.env_args: {tool: calc}``).

``make_calculator_prompt_rows``: ``{"prompt": "What is 347*829?", "answer": "287663"}``.
``make_calculator_sft_rows``: noisy tool-use demonstrations as chat rows: the call
``<tool_call>{"name": "calculator", "arguments": {"expression": "347*829"}}</tool_call>``, the tool's result, the
answer; a share ``noise`` of them go wrong the way a careless writer would (a digit of the expression mistyped, so
the answer is wrong; a guess without the tool; a malformed call answered by the tool's error, then a guess).
Held-out questions are those whose text hashes into the eval bucket, as in ``data/synth.py``.
"""

from __future__ import annotations

import json
import random
import zlib
from typing import Any

#: one question in this many is held out (split "eval")
_EVAL_BUCKETS = 10


def _split_ok(question: str, split: str | None) -> bool:
    return split is None or (zlib.crc32(question.encode()) % _EVAL_BUCKETS == 0) == (split == "eval")


def _questions(n: int, seed: int, split: str | None, digits: int = 3) -> list[tuple[str, int, int]]:
    rng, out = random.Random(seed), []
    low, high = 10 ** (digits - 1), 10**digits - 1
    while len(out) < n:
        a, b = rng.randint(low, high), rng.randint(low, high)
        if _split_ok(f"{a}*{b}", split):
            out.append((f"What is {a}*{b}?", a, b))
    return out


def make_calculator_prompt_rows(n: int, seed: int = 0, *, split: str | None = None,
                                digits: int = 3) -> list[dict[str, Any]]:
    return [{"prompt": q, "answer": str(a * b)} for q, a, b in _questions(n, seed, split, digits)]


def tool_call_text(expression: str, tool: str = "calculator") -> str:
    """A Hermes-format call of the calculator (``tool="calc"``: the short one, written without spaces)."""
    if tool == "calc":
        return "<tool_call>" + json.dumps({"name": "calc", "arguments": {"x": expression}},
                                          separators=(",", ":")) + "</tool_call>"
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"


def _demo(rng: random.Random, q: str, a: int, b: int, noise: float | dict[str, float],
          tool: str) -> list[dict[str, str]]:
    user = {"role": "user", "content": q}
    if isinstance(noise, dict):
        mode = rng.choices(list(noise), list(noise.values()))[0]
    else:
        mode = rng.choice(("typo", "guess", "malformed")) if rng.random() < noise else "clean"
    off = 10 ** len(str(a)) - 1
    if mode == "guess":
        return [user, {"role": "assistant", "content": str(a * b + rng.randint(-off, off))}]
    if mode == "malformed":
        call = tool_call_text(f"{a}*{b}", tool)[:-13]  # the closing tag lost
        error = "Error: malformed tool call (unclosed <tool_call>)"
        return [user, {"role": "assistant", "content": call}, {"role": "tool", "content": error},
                {"role": "assistant", "content": str(a * b + rng.randint(-off, off))}]
    if mode == "typo":
        digits = list(str(a))
        i = rng.randrange(len(digits))
        digits[i] = str((int(digits[i]) + rng.randint(1, 8)) % 10 or 1)
        a = int("".join(digits))
    product = str(a * b)
    return [user, {"role": "assistant", "content": tool_call_text(f"{a}*{b}", tool)},
            {"role": "tool", "content": product}, {"role": "assistant", "content": product}]


def make_calculator_sft_rows(n: int, seed: int = 0, *, split: str | None = None,
                             noise: float | dict[str, float] = 0.4, digits: int = 3,
                             tool: str = "calculator") -> list[dict[str, Any]]:
    """``noise``: the share of noisy demonstrations (typo, guess, malformed alike), or the weight of each mode
    (``{"clean": .., "typo": .., "guess": .., "malformed": ..}``)."""
    rng = random.Random(seed + 1)
    return [{"messages": _demo(rng, q, a, b, noise, tool)} for q, a, b in _questions(n, seed, split, digits)]


def make_calc_prompt_rows(n: int, seed: int = 0, *, split: str | None = None) -> list[dict[str, Any]]:
    """The shipped recipe's questions (``calc-prompts``): products of two 2-digit numbers."""
    return make_calculator_prompt_rows(n, seed, split=split, digits=2)


def make_calc_sft_rows(n: int, seed: int = 0, *, split: str | None = None) -> list[dict[str, Any]]:
    """The shipped recipe's demonstrations (``calc-sft``): 2-digit products through the short ``calc`` call
    (``agent.env_args: {tool: calc}``), half of them noisy."""
    return make_calculator_sft_rows(n, seed, split=split, noise=0.5, digits=2, tool="calc")
