"""benchmarks/learn_grpo_vs_trl.py: the pieces that need no TRL (the exact-match reward, the rise and
standard-error arithmetic), on hand-made cases."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

from bench_rewards import exact_answer
from learn_grpo_vs_trl import compare, mean_min_se, rise_and_final


def test_exact_answer_on_hand_cases() -> None:
    completions = ["56", " 56 \n", "56<|im_end|>junk", "The answer is 56.", "56.", "7*8=56", ""]
    assert exact_answer([None] * 7, completions, answer=["56"] * 7) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert exact_answer(["q"], ["7"], answer=[7]) == [1.0]  # the answer is compared as text
    assert exact_answer(["q", "q"], ["a", "b"]) == [0.0, 0.0]  # no answer column: 0, never None
    assert all(isinstance(x, float) for x in exact_answer(["q"], ["a"], answer=["a"]))


def test_rise_and_final_on_a_hand_series() -> None:
    series = [0.1] * 10 + [0.5] * 40 + [0.3] * 10  # 60 iterations
    rise, final = rise_and_final(series)
    assert rise == pytest.approx(0.2) and final == pytest.approx(0.3)
    assert rise_and_final([0.0, 0.2, 0.4, 0.6]) == pytest.approx((0.4, 0.5))  # short: windows of half the series


def test_mean_min_se_and_compare() -> None:
    s = mean_min_se([0.1, 0.2, 0.3, 0.4])
    assert s["mean"] == pytest.approx(0.25) and s["min"] == pytest.approx(0.1) and s["n"] == 4
    assert s["se"] == pytest.approx(math.sqrt((0.15**2 + 0.05**2) * 2 / 3 / 4))  # sample std / sqrt(n)
    assert mean_min_se([0.5])["se"] == 0.0
    c = compare({"mean": 0.2, "se": 0.03}, {"mean": 0.1, "se": 0.04})
    assert c["diff"] == pytest.approx(0.1) and c["diff_se"] == pytest.approx(0.05)
    assert c["ratio"] == pytest.approx(2.0) and c["ratio_se"] == pytest.approx(2.0 * math.sqrt(0.15**2 + 0.4**2))
    assert "ratio" not in compare({"mean": 0.2, "se": 0.0}, {"mean": 0.0, "se": 0.0})
    assert "ratio" not in compare({"mean": -0.1, "se": 0.0}, {"mean": -0.05, "se": 0.0})


def test_recorded_reward_and_probe_summary() -> None:
    import bench_rewards
    from learn_grpo_vs_trl import probe_summary

    bench_rewards.RECORD = []
    try:  # alignkit passes text prompts and completions, TRL conversational ones: both recorded as text
        assert bench_rewards.exact_answer_recorded(["What is 2*3?"], ["6"], answer=["6"]) == [1.0]
        assert bench_rewards.exact_answer_recorded([[{"role": "user", "content": "What is 2*3?"}]],
                                                   [[{"role": "assistant", "content": "7"}]], answer=["6"]) == [0.0]
        assert bench_rewards.RECORD == [{"prompt": "What is 2*3?", "completion": "6", "reward": 1.0},
                                        {"prompt": "What is 2*3?", "completion": "7", "reward": 0.0}]
    finally:
        bench_rewards.RECORD = None
    rec = lambda p, c, r: {"prompt": p, "completion": c, "reward": r}  # noqa: E731
    ids = {"a": [1, 2], "b": [3]}
    runs = {"alignkit": [{"record": [rec("a", "1", 1.0), rec("a", "", 0.0), rec("b", "x", 0.0), rec("b", "2", 1.0)],
                          "prompt_ids": ids}],
            "trl": [{"record": [rec("a", "1", 1.0), rec("a", "1", 1.0), rec("b", "x", 0.0), rec("b", "y", 0.0)],
                     "prompt_ids": dict(ids), "generation_config": {"top_k": 0}}]}
    s = probe_summary(runs)
    assert s["sides"]["alignkit"]["reward"]["mean"] == pytest.approx(0.5) and s["sides"]["trl"]["reward"]["mean"] == 0.5
    assert s["sides"]["alignkit"]["empty"] == pytest.approx(0.25) and s["sides"]["trl"]["top"][0] == ("1", 2)
    assert s["per_prompt_diff"]["mean"] == pytest.approx(0.0) and s["prompts"] == 2  # a: 0.5 - 1, b: 0.5 - 0
    assert s["same_prompt_ids"] and s["trl_generation_config"] == {"top_k": 0}
    runs["trl"][0]["prompt_ids"] = {"a": [1, 2], "b": [4]}
    assert not probe_summary(runs)["same_prompt_ids"]


def test_window_means_is_the_mean_learning_curve() -> None:
    from learn_grpo_vs_trl import window_means

    runs = [{"rewards": [0.0] * 10 + [1.0] * 10 + [0.5] * 5}, {"rewards": [0.2] * 10 + [0.0] * 10}]
    assert window_means(runs) == pytest.approx([0.1, 0.5])  # whole windows of the shortest run only


def test_trl_overrides_read_json_else_text() -> None:
    from learn_grpo_vs_trl import trl_overrides

    assert trl_overrides(["loss_type=grpo", "epsilon=0.3", "mask_truncated_completions=true", "top_k=0"]) == {
        "loss_type": "grpo", "epsilon": 0.3, "mask_truncated_completions": True, "top_k": 0}
    assert trl_overrides([]) == {}


def test_seed_diagnostics_on_a_hand_run() -> None:
    from learn_grpo_vs_trl import seed_diagnostics

    n = 20  # windows of 10: the first and the last half
    diag = {"clip": [0.0] * 19 + [math.nan], "zero_std": [1.0] * 10 + [0.5] * 10, "entropy": [2.0] * 10 + [1.0] * 10,
            "length": [6.0] * 10 + [3.0] * 10, "grad_norm": [0.5] * 15 + [2.0] * 4 + [math.nan]}
    d = seed_diagnostics(diag)
    assert d["clip"] == 0.0 and d["zero_std"] == pytest.approx(0.75)  # NaN (an unlogged step) left out
    assert (d["entropy_first"], d["entropy_last"], d["length_first"], d["length_last"]) == (2.0, 1.0, 6.0, 3.0)
    assert d["grad_norm"] == pytest.approx((15 * 0.5 + 4 * 2.0) / 19) and d["norm_clipped"] == pytest.approx(4 / 19)
    short = seed_diagnostics({k: v[:4] for k, v in diag.items()})  # 4 iterations: windows of 2
    assert short["entropy_first"] == 2.0 and len(diag["entropy"]) == n
    assert seed_diagnostics({}) == {}


def test_summarize_pairs_the_sides_seed_by_seed() -> None:
    """Both sides train seed s on the same prompt order: the per-seed difference, and on how many seeds
    alignkit is higher."""
    from learn_grpo_vs_trl import summarize

    def run(first: float, last: float) -> dict:
        return {"ok": True, "wall_s": 60.0, "rewards": [first] * 10 + [last] * 10}

    runs = {"alignkit": [run(0.1, 0.3), run(0.2, 0.3)], "trl": [run(0.1, 0.2), run(0.1, 0.4)]}
    s = summarize(runs)
    assert s["paired_final"]["mean"] == pytest.approx(0.0) and s["paired_final"]["alignkit_higher"] == 1
    assert s["paired_rise"]["mean"] == pytest.approx((0.1 - 0.2) / 2)  # rises: +0.2 vs +0.1, +0.1 vs +0.3
    assert s["paired_rise"]["se"] == pytest.approx(0.15)  # differences +0.1, -0.2: std 0.212, / sqrt(2)
