"""The seams, proven from outside the package (ARCHITECTURE 7, 7b, 9b; docs/architecture.md "how to add"):
a toy red-team algorithm whose rollout sends the policy's completions through a frozen ``target`` role
before scoring (tests/plugins/redteam_toy.py), a toy non-token model kind trained by alignkit's own
GRPO (tests/plugins/bandit_kind.py), and a rollout engine that records its lifecycle
(tests/plugins/recording_engine.py). Each is registered by the config's ``plugins:`` and trained
through the CLI (the first two in one process and under 2-process DDP)."""

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


def test_a_plugin_rollout_engine_runs_its_lifecycle(micro_model: Path, prompts: Path, tmp_path: Path) -> None:
    """``rollout.engine: recording``, built from its own section; every generation (the step-0 evaluation, two
    rollouts, the final evaluation) is one phase sync_weights -> wake -> generate -> sleep, and the weights count as
    changed exactly where an optimizer step came between two phases. The memory planner leaves the engine its share."""
    out, calls = tmp_path / "run", tmp_path / "calls.jsonl"
    evals = write_rows(make_prompt_rows(3, seed=1), tmp_path / "eval.jsonl")
    cfg = base(micro_model, prompts, out, 1, plugins=["tests.plugins.recording_engine"], algorithm="grpo",
               data={"eval": str(evals)}, rollout={"max_new_tokens": 6, "engine": "recording"},
               recording_engine={"log": str(calls), "reserved": 0.25},
               reward={"functions": [{"name": "length"}]})
    logged = train(cfg, tmp_path, 1)
    steps = [r for r in logged if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["loss"] == r["loss"] for r in steps)
    assert [r["step"] for r in logged if "eval/reward_mean" in r] == [0, 2]
    record = [json.loads(x) for x in calls.read_text().splitlines()]
    assert record[0] == {"call": "from_settings", "rank": 0, "max_model_len": 48 + 6, "dtype": "auto"}
    phases = [record[i : i + 4] for i in range(1, len(record), 4)]
    assert [[c["call"] for c in p] for p in phases] == [["sync_weights", "wake", "generate", "sleep"]] * 4, record
    # step-0 eval (first push), rollout 1 (same weights), rollout 2 (after step 1), final eval (after step 2)
    assert [p[0]["changed"] for p in phases] == [True, False, True, True]
    assert [(p[2]["prompts"], p[2]["temperature"]) for p in phases] == [(3, 0.0), (8, 1.0), (8, 1.0), (3, 0.0)]
    estimate = run_cli(["estimate", str(tmp_path / "run.yaml"), "--gpu-memory", "80GB"], cwd=REPO)
    assert_ok(estimate)
    assert f"{(0.9 - 0.25) * 80:.1f} GB usable" in estimate.stdout.splitlines()[-1], estimate.stdout


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_a_plugin_algorithm_declares_its_own_experience_field_and_role(micro_model: Path, prompts: Path,
                                                                       tmp_path: Path, nproc: int) -> None:
    """tests/plugins/judged_grpo.py: a ``judge`` role and a per-token ``judge_logps`` field named by the plugin
    alone; the judge is loaded and read in the rollout, and the field reaches the loss at the completion
    positions (the loss's token mean of it equals the rollout's, over every rank)."""
    out = tmp_path / "run"
    cfg = base(micro_model, prompts, out, nproc, plugins=["tests.plugins.judged_grpo"], algorithm="judged_grpo",
               rollout={"max_new_tokens": 6}, reward={"functions": [{"name": "length"}]})
    logged = train(cfg, tmp_path, nproc)
    assert [r["step"] for r in logged] == [1, 2]
    for row in logged:
        assert row["judge_logp"] < 0 and row["judge_logp"] == pytest.approx(row["judge_logp_rollout"], rel=1e-5)
