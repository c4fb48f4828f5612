"""Rewards both sides of a TRL comparison use (an alignkit ``module:function`` and a TRL reward function):
``digit_fraction`` for ``bench_grpo.py``, ``exact_answer`` for ``learn_grpo_vs_trl.py``."""

from __future__ import annotations

from typing import Any


def digit_fraction(prompts: list[Any], completions: list[str], **_: Any) -> list[float | None]:
    """The fraction of the completion's characters that are digits (0 for an empty one)."""
    return [sum(ch.isdigit() for ch in c) / len(c) if c else 0.0 for c in completions]


def exact_answer(prompts: list[Any], completions: list[str], answer: list[Any] | None = None,
                 **_: Any) -> list[float]:
    """``learn_grpo_vs_trl.py``: 1.0 when the completion (cut at the first ``<|im_end|>``, stripped) equals the
    row's ``answer`` exactly, else 0.0 (also without an answer). Plain Python: alignkit and TRL call it alike."""
    answers = answer if answer is not None else [None] * len(completions)
    return [float(a is not None and c.split("<|im_end|>")[0].strip() == str(a).strip())
            for c, a in zip(completions, answers)]


#: ``learn_grpo_vs_trl.py --probe``: when a list, :func:`exact_answer_recorded` appends one
#: ``{"prompt", "completion", "reward"}`` per completion (the prompt as the user turn's text on both sides)
RECORD: list[dict[str, Any]] | None = None


def exact_answer_recorded(prompts: list[Any], completions: list[Any], answer: list[Any] | None = None,
                          **_: Any) -> list[float]:
    """:func:`exact_answer`, recording what it scored into :data:`RECORD` (TRL's conversational prompts
    and completions are read as their text)."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    scores = exact_answer(prompts, texts, answer=answer)
    if RECORD is not None:
        for p, c, s in zip(prompts, texts, scores):
            RECORD.append({"prompt": p[-1]["content"] if isinstance(p, list) else p, "completion": c, "reward": s})
    return scores
