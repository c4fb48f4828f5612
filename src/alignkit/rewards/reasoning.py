"""Rewards of reasoning completions with one final answer: ``math_verify`` (the final answer equals the row's
``answer``, compared by Hugging Face's maintained math verifier) and ``reasoning_format`` (the reasoning, then
exactly one final answer in the asked form). ``functions.py`` registers both.

The final answer is written either as ``\\boxed{...}`` (Qwen2.5-Math's and DeepSeek-R1's convention) or after
``####`` on the last line (GSM8K's own answers and verl's GSM8K recipe, the convention
``examples/grpo_qwen2.5-1.5b_gsm8k.yaml`` asks for); both are read. The row's ``answer`` may be a GSM8K answer
("... #### 72": what follows the last ``####`` is the reference) or the reference alone (``72``,
``\\frac{1}{2}``). ``math-verify`` is the optional extra ``alignkit[math]``.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from alignkit.errors import ConfigError

#: the text after the last ``####`` up to the end of its line
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
#: a thousands separator inside a plain number (1,000 -> 1000)
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
#: the reasoning before the final answer: at least this many words
MIN_REASONING_WORDS = 5
#: after the final answer: at most this many characters (a closing period, "dollars", ...)
MAX_TRAILING_CHARS = 40


def _strip(text: str) -> str:  # a chat model's end-of-turn marker and what follows it
    return text.split("<|im_end|>")[0].strip()


def _math_verify() -> Any:
    try:
        import math_verify
    except ImportError:
        raise ConfigError("reward.functions math_verify needs the math extra: pip install 'alignkit[math]' "
                          "(math-verify)") from None
    return math_verify


def boxed_spans(text: str) -> list[tuple[int, int, str]]:
    """Every ``\\boxed{...}`` of ``text`` (braces balanced): (start, end, content)."""
    out, i = [], text.find("\\boxed{")
    while i >= 0:
        depth, end = 0, -1
        for j in range(i + len("\\boxed"), len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                end = j
                break
        if end < 0:  # unclosed: not an answer
            break
        out.append((i, end + 1, text[i + len("\\boxed{"):end]))
        i = text.find("\\boxed{", end + 1)
    return out


def final_answers(text: str) -> list[tuple[int, int, str]]:
    """The completion's final answers in order, (start, end, answer text): each ``\\boxed{...}`` and each
    ``#### ...`` (to the end of its line; a ``#### \\boxed{x}`` counts once)."""
    boxed = boxed_spans(text)
    hashes = [(m.start(), m.end(), m.group(1).strip()) for m in _HASHES.finditer(text)]
    hashes = [h for h in hashes if not any(h[0] <= b[0] < h[1] for b in boxed)]
    return sorted(boxed + [h for h in hashes if h[2]])


def reference(answer: Any) -> str:
    """The row's reference answer: what follows the last ``####`` of a GSM8K answer, else the text itself."""
    text = str(answer)
    return text.rsplit("####", 1)[-1].strip() if "####" in text else text.strip()


def _clean(answer: str) -> str:
    return _THOUSANDS.sub("", answer.strip().rstrip(".").replace("\\$", "").replace("$", "").strip())


def _parse(mv: Any, answer: str) -> list[Any]:
    # math-verify's timeout is a SIGALRM: only the main thread may set it (elsewhere: no timeout, the answers
    # are short spans)
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    extraction = [mv.LatexExtractionConfig(), mv.ExprExtractionConfig()]
    return mv.parse(f"${_clean(answer)}$", extraction_config=extraction, parsing_timeout=timeout)


def _equal(mv: Any, gold: list[Any], answer: str) -> bool:
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    pred = _parse(mv, answer)
    return bool(gold and pred and mv.verify(gold, pred, timeout_seconds=timeout))


def math_verified(prompts: list[Any], completions: list[str], *, answer: list[Any] | None = None,
                  **_: Any) -> list[float | None]:
    """1.0 when the completion's final answer (``\\boxed{...}`` or after ``####``) equals the row's ``answer``
    by math-verify (``72``, ``72.0``, ``\\frac{144}{2}``, ``$72`` and ``1,000`` vs ``1000`` are equal); 0.0
    when it is wrong, missing, or when several final answers are not all right; None for a row without an
    answer. Needs ``pip install 'alignkit[math]'``."""
    mv = _math_verify()
    out: list[float | None] = []
    for completion, ans in zip(completions, answer or [None] * len(completions)):
        if ans is None:
            out.append(None)
            continue
        gold = _parse(mv, reference(ans))
        finals = [a for _, _, a in final_answers(_strip(completion))]
        out.append(float(bool(finals) and all(_equal(mv, gold, a) for a in finals)))
    return out


math_verified.requires = _math_verify  # type: ignore[attr-defined]  # resolve() checks the extra up front


def reasoning_format(prompts: list[Any], completions: list[str], **_: Any) -> list[float | None]:
    """1.0 when the completion reasons (at least 5 words) and then gives exactly one non-empty final answer,
    ``\\boxed{...}`` or after ``####``, at its end (at most 40 characters after it), else 0.0. The form is not
    checked for being right (``math_verify`` does that)."""
    out: list[float | None] = []
    for completion in completions:
        text = _strip(completion)
        finals = final_answers(text)
        ok = (len(finals) == 1 and bool(finals[0][2].strip())
              and len(text[:finals[0][0]].split()) >= MIN_REASONING_WORDS
              and len(text[finals[0][1]:].strip()) <= MAX_TRAILING_CHARS)
        out.append(float(ok))
    return out
