"""The calculator task's data (data/synth_agents.py): the recipe's builtin files are what the generators write,
2-digit questions, demonstrations through the short ``calc`` call the shipped environment answers (issue 48)."""

from __future__ import annotations

import json
from collections import Counter

from alignkit.data.synth_agents import make_calc_prompt_rows, make_calc_sft_rows, make_calculator_sft_rows
from alignkit.resources import resource_path
from alignkit.rollout.agents.calculator import CalculatorEnv
from alignkit.rollout.agents.env import EnvState


def _rows(name: str) -> list[dict]:
    return [json.loads(x) for x in resource_path(name).read_text(encoding="utf-8").splitlines()]


def test_builtin_files_are_the_generators() -> None:
    assert _rows("calc_sft_train.jsonl") == make_calc_sft_rows(2000, 14, split="train")
    assert _rows("calc_prompts_train.jsonl") == make_calc_prompt_rows(2000, 15, split="train")
    held_out = _rows("calc_prompts_eval.jsonl")
    assert held_out == make_calc_prompt_rows(64, 16, split="eval")
    train = {r["prompt"] for r in _rows("calc_prompts_train.jsonl")}
    assert not train & {r["prompt"] for r in held_out}


def test_calc_demonstrations_run_in_the_environment() -> None:
    """Every demonstration's call, replayed in ``calculator`` with ``env_args {tool: calc}``, gets the tool answer
    the demonstration shows; the noisy half splits into typos, guesses and malformed calls."""
    env = CalculatorEnv({"tool": "calc"})
    kinds: Counter = Counter()
    for row in make_calc_sft_rows(300, 0):
        user, first, *rest = row["messages"]
        a, b = map(int, user["content"].removeprefix("What is ").rstrip("?").split("*"))
        assert 10 <= a <= 99 and 10 <= b <= 99
        state = EnvState({"prompt": user["content"], "answer": str(a * b)}, [])
        result = env.step(state, first["content"])
        if not rest:
            kinds["guess"] += 1
            assert result.done
            continue
        assert result.messages == [rest[0]], row
        kinds["malformed" if state.counts["malformed"] else "right" if rest[1]["content"] == str(a * b) else "typo"] += 1
    assert set(kinds) == {"right", "typo", "guess", "malformed"} and 0.4 < kinds["right"] / 300 < 0.6, kinds
    # the 3-digit default keeps the long call
    assert '"name": "calculator"' in make_calculator_sft_rows(1, 0, noise=0.0)[0]["messages"][1]["content"]
