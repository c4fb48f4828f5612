"""Stand-ins for the red-team tests: a scorer that is a known function of the text it reads (so a test can
recompute every rank's rewards from attacks.jsonl) and a scripted target."""

from __future__ import annotations

from typing import Any


def vowel_share(prompts: list[Any], completions: list[str], **_: Any) -> list[float]:
    """The share of vowels among the letters of each target output (0 without letters)."""
    out = []
    for text in completions:
        letters = [c for c in text.lower() if c.isalpha()]
        out.append(sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0)
    return out


def attack_length(prompts: list[Any], completions: list[str], **_: Any) -> list[float]:
    """A quality stand-in: the attack's length in characters over 100."""
    return [len(p) / 100 for p in prompts]


def echo_target(attacks: list[str], **_: Any) -> list[str]:
    """A scripted target: answers each attack with the attack upper-cased."""
    return [a.upper() for a in attacks]
