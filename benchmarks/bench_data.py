"""Synthetic arithmetic preference rows with the length profile of BASELINES.md.

A row asks ``"What is 37+45?"`` after 0-4 preamble sentences; ``chosen`` is the right answer plus a
worked explanation (several sentences), ``rejected`` a wrong answer plus a flawed, usually shorter
one. With the tiny-model tokenizer and its chat template (one user turn, one assistant turn),
2000 rows give prompt+chosen 49-281 tokens (median 153) and prompt+rejected 36-243 (median 123);
the TRL baseline's data had 49-281 (median 152) and 34-244 (median 123). ``python benchmarks/bench_data.py MODEL_DIR`` prints the profile.

Pure and deterministic: ``random.Random(seed)`` drives everything. Depends only on the standard
library, so both the alignkit and the TRL benchmark children import it (``peak_rss_mib`` too).
"""

from __future__ import annotations

import json
import random
import resource
import statistics
import sys
from pathlib import Path
from typing import Any

PREAMBLES = (
    "Please answer briefly.", "Here is a quick question.", "Keep it short.", "Answer in one line.",
    "This is a small exercise.", "Let us practise.", "Think, then answer.", "Be precise.",
    "I am checking my homework tonight.", "My teacher gave us this sum in class today.",
    "Show the steps, please.", "We are learning to add two-digit numbers.",
)


def _split(n: int) -> tuple[int, int]:
    return n // 10, n % 10


def _right_steps(a: int, b: int) -> list[str]:
    """Correct explanation sentences, in a sensible order."""
    (at, ao), (bt, bo) = _split(a), _split(b)
    s, ones, tens = a + b, ao + bo, (at + bt) * 10
    carry = ones >= 10
    steps = [
        f"We need to add {a} and {b}.",
        f"Split {a} into {at * 10} and {ao}, and split {b} into {bt * 10} and {bo}.",
        f"First add the tens: {at * 10}+{bt * 10}={tens}.",
        f"Then add the ones: {ao}+{bo}={ones}.",
        (f"Since {ones} is at least 10, we carry 1 to the tens, so the tens become {tens + 10}."
         if carry else f"Since {ones} is less than 10, there is nothing to carry."),
        f"Now combine the parts: {tens}+{ones}={s}.",
        f"We can check by subtracting: {s}-{b}={a}, which is the first number again.",
        f"Another check: {b}+{a}={s}, because the order of addition does not matter.",
        f"So {a}+{b}={s} is correct.",
    ]
    return steps


def _wrong_steps(a: int, b: int, wrong: int) -> list[str]:
    """A flawed explanation (forgets the carry or slips a digit) that ends at ``wrong``."""
    (at, ao), (bt, bo) = _split(a), _split(b)
    tens = (at + bt) * 10
    ones = max(wrong - tens, 0)
    return [
        f"We add {a} and {b}.",
        f"Split {a} into {at * 10} and {ao}, and split {b} into {bt * 10} and {bo}.",
        f"The tens give {at * 10}+{bt * 10}={tens}.",
        f"The ones give {ao}+{bo}={ones}.",
        f"There is no need to carry anything here, so the tens stay at {tens}.",
        f"Putting it together: {tens}+{ones}={wrong}.",
        f"We can check by subtracting: {wrong}-{b}={wrong - b}, which is close enough to {a}.",
        f"Another check: {b}+{a}={wrong}, since the order does not matter.",
        f"So {a}+{b}={wrong}.",
    ]


#: Weights of how many explanation sentences a chosen (1..9) / rejected (0..9) response gets; tuned so
#: the token-length profile matches BASELINES.md (see the module docstring).
_CHOSEN_WEIGHTS = (1, 1, 1, 1, 1, 1.2, 1.2, 1.3, 1.3)
_REJECTED_WEIGHTS = (0, 1, 1, 1, 1, 1, 1, 1, 1, 1)
_PREAMBLE_WEIGHTS = (3, 3, 2, 1, 1)  # 0..4 preamble sentences


def make_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` rows ``{"prompt", "chosen", "rejected"}`` as message lists, plus ``"messages"`` for SFT."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        k = rng.choices(range(len(_PREAMBLE_WEIGHTS)), weights=_PREAMBLE_WEIGHTS)[0]
        question = " ".join(rng.sample(PREAMBLES, k) + [f"What is {a}+{b}?"])
        s = a + b
        wrong = s + rng.choice((-10, -2, -1, 1, 2, 10))
        right = _right_steps(a, b)
        n_right = rng.choices(range(1, len(right) + 1), weights=_CHOSEN_WEIGHTS)[0]
        chosen = " ".join(["Let us see.", f"The answer is {s}."] + right[:n_right] + [f"The answer is {s}."])
        flawed = _wrong_steps(a, b, wrong)
        n_wrong = rng.choices(range(len(flawed) + 1), weights=_REJECTED_WEIGHTS)[0]
        rejected = " ".join([f"The answer is {wrong}."] + flawed[:n_wrong])
        user = {"role": "user", "content": question}
        rows.append({
            "prompt": [user],
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}],
            "messages": [user, {"role": "assistant", "content": chosen}],
        })
    return rows


def write_jsonl(rows: list[dict[str, Any]], path: str | Path, keys: tuple[str, ...]) -> Path:
    """Write only ``keys`` of each row (SFT: messages; DPO: prompt/chosen/rejected)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({k: r[k] for k in keys}) + "\n")
    return path


def length_profile(rows: list[dict[str, Any]], tokenizer: Any) -> dict[str, dict[str, float]]:
    """min / median / max tokens of prompt+chosen and prompt+rejected under the chat template."""
    out = {}
    for side in ("chosen", "rejected"):
        lens = [len(tokenizer.apply_chat_template(r["prompt"] + r[side], tokenize=True, return_dict=True)["input_ids"])
                for r in rows]
        out[side] = {"min": min(lens), "median": statistics.median(lens), "max": max(lens),
                     "over_256": sum(x > 256 for x in lens)}
    return out


if __name__ == "__main__":
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    print(json.dumps(length_profile(make_rows(2000, 0), tok), indent=1))


def peak_rss_mib() -> float:
    """This process's own peak RSS (MiB): ``VmHWM`` on Linux. ``ru_maxrss`` keeps the peak of the process that
    started this one across ``exec`` (a benchmark child would report its parent's peak when that was larger)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:  # not Linux
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1024 if sys.platform != "darwin" else rss / 2**20
