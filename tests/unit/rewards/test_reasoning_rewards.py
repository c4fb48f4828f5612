"""reward.functions ``math_verify`` and ``reasoning_format`` (rewards/reasoning.py) on hand-written completions:
the right answer in several forms, wrong, missing, two answers, LaTeX fractions; GSM8K's "... #### 72" answers."""

from __future__ import annotations

import sys

import pytest

from alignkit.errors import ConfigError
from alignkit.rewards.functions import resolve
from alignkit.rewards.reasoning import final_answers, reference

pytest.importorskip("math_verify")

WHY = "Natalia sold 48 clips in April and half as many in May, so 48 + 24 = 72 clips in all."
GSM8K = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"

# (completion, the row's answer, math_verify, reasoning_format)
CASES = {
    "boxed": (WHY + " \\boxed{72}", GSM8K, 1.0, 1.0),
    "hashes": (WHY + "\n#### 72", GSM8K, 1.0, 1.0),
    "decimal": (WHY + "\n#### 72.0", GSM8K, 1.0, 1.0),
    "dollars": (WHY + "\n#### $72", GSM8K, 1.0, 1.0),
    "escaped dollars in a box": (WHY + " \\boxed{\\$72}", GSM8K, 1.0, 1.0),
    "fraction equal to the number": (WHY + " \\boxed{\\frac{144}{2}}", GSM8K, 1.0, 1.0),
    "thousands separator": (WHY + "\n#### 1,000", "#### 1000", 1.0, 1.0),
    "boxed inside the hashes": (WHY + "\n#### \\boxed{72}", GSM8K, 1.0, 1.0),
    "closing period": (WHY + " The answer is \\boxed{72}.", GSM8K, 1.0, 1.0),
    "chat end token": (WHY + " \\boxed{72}<|im_end|>", GSM8K, 1.0, 1.0),
    "latex fraction vs plain": (WHY + " \\boxed{\\dfrac{1}{2}}", "1/2", 1.0, 1.0),
    "decimal vs latex fraction": (WHY + " \\boxed{0.5}", "\\frac{1}{2}", 1.0, 1.0),
    "nested braces": (WHY + " \\boxed{\\frac{3}{4}}", "0.75", 1.0, 1.0),
    "negative": (WHY + "\n#### -3", "#### -3", 1.0, 1.0),
    "wrong": (WHY + " \\boxed{71}", GSM8K, 0.0, 1.0),
    "wrong fraction": (WHY + " \\boxed{\\frac{1}{3}}", "1/2", 0.0, 1.0),
    "missing: no final answer form": (WHY + " The answer is 72.", GSM8K, 0.0, 0.0),
    "empty box": (WHY + " \\boxed{}", GSM8K, 0.0, 0.0),
    "unclosed box": (WHY + " \\boxed{72", GSM8K, 0.0, 0.0),
    "two different answers": (WHY + " \\boxed{72} or maybe \\boxed{73}", GSM8K, 0.0, 0.0),
    "the same answer twice": (WHY + " \\boxed{72}\n#### 72", GSM8K, 1.0, 0.0),
    "no reasoning": ("\\boxed{72}", GSM8K, 1.0, 0.0),
    "talk after the answer": (WHY + "\n#### 72\nBut let me also say a lot more about clips, April and May here.",
                              GSM8K, 1.0, 0.0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_hand_written_completion(name: str) -> None:
    completion, answer, want_verified, want_format = CASES[name]
    assert resolve("math_verify")(["q"], [completion], answer=[answer]) == [want_verified]
    assert resolve("reasoning_format")(["q"], [completion]) == [want_format]


def test_a_row_without_an_answer_is_not_scored() -> None:
    assert resolve("math_verify")(["q", "q"], [WHY + " \\boxed{1}"] * 2, answer=[None, "1"]) == [None, 1.0]
    assert resolve("math_verify")(["q"], [WHY + " \\boxed{1}"]) == [None]


def test_reference_and_final_answers() -> None:
    assert reference(GSM8K) == "72" and reference(" \\frac{1}{2} ") == "\\frac{1}{2}" and reference(7) == "7"
    text = "a \\boxed{\\frac{1}{2}} b\n#### 3 apples\nc"
    assert [a for _, _, a in final_answers(text)] == ["\\frac{1}{2}", "3 apples"]


def test_the_missing_extra_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'alignkit\[math\]'") as e:
        resolve("math_verify")
    assert "\n" not in str(e.value)
    resolve("reasoning_format")  # needs no extra
