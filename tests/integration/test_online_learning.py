"""Learning on the shipped verifiable task (single-digit sums, ``builtin:digits_*``) with the shipped
recipes: a micro Llama is SFT'd (configs/sft_digits.yaml) on rows that answer in three forms ("7",
"The answer is 7.", "3+4=7"), so a sampled answer is an exact match (the bare, right number) about 9%
of the time; then

* GRPO and PPO with the exact-match reward raise the mean sampled reward clearly above its start;
* Lagrangian PPO with the judged-correct reward and the answer length in words as the cost brings the
  cost under its threshold (1.5 words; the SFT policy starts near 2) while judged correctness is kept.

Measured on 2 CPU cores, seeds 0-3 (``training.seed``; 60 iterations of 64 completions for GRPO / PPO;
``reward_mean`` of the first 10-iteration window -> mean of the last two windows), with the rollout's
inverse-CDF sampler (``rollout/engine.py``; the earlier ``torch.multinomial`` runs gave GRPO rises
0.068-0.114 and PPO 0.098-0.132, the same effect):

    GRPO  0.045 -> 0.184   0.092 -> 0.166   0.106 -> 0.176   0.089 -> 0.204   (rise >= 0.070)
    PPO   0.091 -> 0.167   0.092 -> 0.153   0.120 -> 0.228   0.102 -> 0.193   (rise >= 0.061)
    PPO-Lag (40 iterations): cost of the first 2 iterations 2.08 1.96 1.90 2.23; J_C at the end 1.02 1.10
    1.09 1.02; lambda peaked at 1.42-2.39; judged correctness, first -> last 10 iterations: 0.170 -> 0.188,
    0.192 -> 0.188, 0.158 -> 0.208, 0.200 -> 0.192.

The thresholds keep about half of the smallest measured effect as margin. About 1.5 minutes on an idle
2-core machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import assert_ok, run_cli

pytestmark = pytest.mark.slow

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MIN_RISE = 0.035  # GRPO / PPO: mean reward of the last 20 iterations minus the first 10


@pytest.fixture(scope="module")
def sft_policy(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sft_digits")
    assert_ok(run_cli(["train", str(CONFIGS / "sft_digits.yaml"), f"model.name_or_path={micro_model}",
                       f"output_dir={out}", "logging.plot=false"]))
    return out / "final"


def rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def run_recipe(name: str, policy: Path, out: Path, steps: int, *extra: str) -> list[dict[str, Any]]:
    assert_ok(run_cli(["train", str(CONFIGS / f"{name}.yaml"), f"model.name_or_path={policy}", f"output_dir={out}",
                       f"training.max_steps={steps}", "data.eval=[]", "logging.plot=false", *extra], timeout=900))
    return rows(out)


def series(logged: list[dict[str, Any]], key: str) -> list[float]:
    """``key`` of every logged training window, in order."""
    return [r[key] for r in logged if key in r]


@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_reward_rises(sft_policy: Path, tmp_path: Path, recipe: str) -> None:
    reward = series(run_recipe(recipe, sft_policy, tmp_path / recipe, 60), "reward_mean")  # windows of 10
    assert len(reward) == 6
    rise = (reward[-1] + reward[-2]) / 2 - reward[0]
    assert rise >= MIN_RISE, (recipe, reward)


def test_lagrangian_ppo_holds_the_cost(sft_policy: Path, tmp_path: Path) -> None:
    logged = run_recipe("ppo_lag", sft_policy, tmp_path / "lag", 40, "logging.logging_steps=2")
    cost = series(logged, "cost_mean")  # windows of 2 iterations: the mean cost of their completions
    j_c, lam, correct = series(logged, "J_C"), series(logged, "lambda"), series(logged, "reward_mean")
    threshold = 1.5  # configs/ppo_lag.yaml: mean answer length in words
    assert cost[0] > threshold, cost  # the SFT policy starts above the limit ...
    assert j_c[-1] <= threshold and sum(cost[-5:]) / 5 <= threshold, (j_c, cost)  # ... and ends within it
    assert max(lam) > 1.0, lam  # the multiplier rose while the constraint was violated
    assert sum(correct[-5:]) / 5 >= sum(correct[:5]) / 5 - 0.08, correct  # correctness kept while the form changes
