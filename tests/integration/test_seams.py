"""The seams, proven from outside the package (ARCHITECTURE 7, 7b; docs/architecture.md "how to add"):
a toy red-team algorithm whose rollout sends the policy's completions through a frozen ``target`` role
before scoring (tests/plugins/redteam_toy.py), and a toy non-token model kind trained by alignkit's own
GRPO (tests/plugins/bandit_kind.py). Both are registered by the config's ``plugins:`` and trained
through the CLI, in one process and under 2-process DDP."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from alignkit.data.synth import make_prompt_rows, write_rows
from tests.conftest import REPO, assert_ok, run_cli, write_config


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_rows(make_prompt_rows(24, seed=0), tmp_path_factory.mktemp("seams") / "prompts.jsonl")


def train(cfg: dict[str, Any], tmp_path: Path, nproc: int) -> list[dict[str, Any]]:
    path = write_config(tmp_path / "run.yaml", cfg)
    assert_ok(run_cli(["train", str(path)], nproc=nproc, cwd=REPO, timeout=400))
    return [json.loads(x) for x in (Path(cfg["output_dir"]) / "metrics.jsonl").read_text().splitlines()]


def base(model_dir: Path, prompts: Path, out: Path, nproc: int, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model": {"name_or_path": str(model_dir)}, "output_dir": str(out),
        "data": {"train": str(prompts), "max_length": 48},
        "training": {"global_batch_size": 8, "per_device_batch_size": 8 // nproc, "max_steps": 2},
        "distributed": {"strategy": "ddp" if nproc > 1 else "single"},
        "logging": {"logging_steps": 1, "plot": False}, "rollout": {"num_generations": 4, "log_samples": 4},
    }
    for k, v in extra.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    return cfg


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_a_plugin_algorithm_rewards_the_targets_answer(micro_model: Path, prompts: Path, tmp_path: Path,
                                                      nproc: int) -> None:
    from alignkit.models.loading import load_tokenizer
    from alignkit.config.schema import ModelConfig
    from alignkit.rollout.generate import generate
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    cfg = base(micro_model, prompts, out, nproc, plugins=["tests.plugins.redteam_toy"], algorithm="toy_redteam",
               rollout={"max_new_tokens": 6},
               reward={"functions": [{"name": "tests.plugins.redteam_toy:answer_words"}]})
    logged = train(cfg, tmp_path, nproc)
    assert [r["step"] for r in logged] == [1, 2] and all(r["loss"] == r["loss"] for r in logged)
    assert "reward/tests.plugins.redteam_toy:answer_words" in logged[-1]
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 and all("target" in s for s in samples)
    # the frozen target (the micro model) answered each logged attack: its greedy answer, recomputed here
    tok = load_tokenizer(ModelConfig(name_or_path=str(micro_model)))
    target = AutoModelForCausalLM.from_pretrained(str(micro_model), torch_dtype=torch.float32).eval()
    assert generate(target, tok, [s["completion"] for s in samples], max_new_tokens=6) == [s["target"] for s in samples]
    assert any(s["target"] != s["completion"] for s in samples)  # what was scored is not the attack itself


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_a_plugin_model_kind_is_trained_by_grpo(micro_model: Path, prompts: Path, tmp_path: Path, nproc: int) -> None:
    out = tmp_path / "run"
    cfg = base(micro_model, prompts, out, nproc, plugins=["tests.plugins.bandit_kind"], algorithm="grpo",
               model={"kind": "toy_bandit"}, rollout={"max_new_tokens": 1},
               reward={"functions": [{"name": "tests.plugins.bandit_kind:pick_c"}]},
               training={"max_steps": 16, "learning_rate": 0.3, "lr_scheduler": "constant", "warmup_steps": 0})
    logged = train(cfg, tmp_path, nproc)
    rewards = [r["reward_mean"] for r in logged]
    # the table starts uniform (P(C) = 0.25); seeds 0 (1 and 2 processes): first two 0.06 / 0.25, last four 1.0 / 0.94
    assert len(rewards) == 16 and sum(rewards[:2]) / 2 < 0.5 and sum(rewards[-4:]) / 4 >= 0.75, rewards
    final = out / "final"
    assert (final / "bandit.json").is_file() and not (final / "config.json").exists()  # the kind's own format

    from tests.plugins.bandit_kind import BanditKind, TablePolicy

    policy = BanditKind().build(type("Spec", (), {"source": str(final)})(), None, torch.float32, None)
    p_c = policy.table.detach().softmax(1)[:, 2]
    assert isinstance(policy, TablePolicy) and float(p_c.max()) >= 0.9  # "C" learned for the prompts' context
