"""Learning on the shipped verifiable task (single-digit sums, ``builtin:digits_*``) with the shipped
recipes, shortened: a micro Llama is SFT'd on rows that answer in three forms ("7", "The answer is 7.",
"3+4=7"), so greedy exact match starts near 8% (judged correctness ~57%); then

* GRPO and PPO with the exact-match reward raise the mean sampled reward clearly above its start;
* Lagrangian PPO with the judged-correct reward and the answer length in words as the cost brings the
  cost window J_C under its threshold (plain PPO has no reason to: the cost starts above it).

Margins measured (2 CPU cores, micro model, 40 iterations of 64 completions; window means of
``reward_mean`` over iterations 1-10 vs 31-40): GRPO seeds 0/1 +0.16/+0.13, PPO seed 0 +0.12 (see the
issue note for the full table). The thresholds below keep about half of the smallest rise as margin.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import assert_ok, run_cli

pytestmark = pytest.mark.slow

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
STEPS = 40
MIN_RISE = 0.06  # GRPO / PPO: mean reward of the last 10 iterations minus the first 10


@pytest.fixture(scope="module")
def sft_policy(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sft_digits")
    assert_ok(run_cli(["train", str(CONFIGS / "sft_digits.yaml"), f"model.name_or_path={micro_model}",
                       f"output_dir={out}", "logging.plot=false"]))
    return out / "final"


def rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def run_recipe(name: str, policy: Path, out: Path, *extra: str) -> list[dict[str, Any]]:
    assert_ok(run_cli(["train", str(CONFIGS / f"{name}.yaml"), f"model.name_or_path={policy}", f"output_dir={out}",
                       f"training.max_steps={STEPS}", "logging.plot=false", *extra], timeout=900))
    return rows(out)


def window_means(logged: list[dict[str, Any]], key: str) -> tuple[float, float]:
    """Means of ``key`` over the first and the last logged windows (``logging_steps`` iterations each)."""
    values = [r[key] for r in logged if key in r and "eval/reward_mean" not in r]
    return values[0], values[-1]


@pytest.mark.parametrize("recipe", ["grpo", "ppo"])
def test_reward_rises(sft_policy: Path, tmp_path: Path, recipe: str) -> None:
    logged = run_recipe(recipe, sft_policy, tmp_path / recipe, "training.eval_steps=1000")
    first, last = window_means(logged, "reward_mean")
    assert last >= first + MIN_RISE, (recipe, first, last)
    evals = [r["eval/reward_mean"] for r in logged if "eval/reward_mean" in r]
    assert evals[-1] > evals[0], evals  # greedy exact match on held-out prompts, before and after


def test_lagrangian_ppo_holds_the_cost(sft_policy: Path, tmp_path: Path) -> None:
    logged = run_recipe("ppo_lag", sft_policy, tmp_path / "lag", "logging.logging_steps=2")
    cost = [r["cost_mean"] for r in logged if "cost_mean" in r]  # window means of the iterations' mean cost
    j_c = [r["J_C"] for r in logged if "J_C" in r]
    lam = [r["lambda"] for r in logged if "lambda" in r]
    threshold = 1.5  # configs/ppo_lag.yaml: mean answer length in words
    assert cost[0] > threshold, cost  # the SFT policy starts above the limit ...
    assert j_c[-1] <= threshold and cost[-1] <= threshold, (j_c, cost)  # ... and ends within it
    assert max(lam) > 1.0  # the multiplier rose while the constraint was violated
    correct = [r["reward_mean"] for r in logged if "reward_mean" in r]
    assert correct[-1] >= correct[0] - 0.1, correct  # judged correctness is kept while the form changes
