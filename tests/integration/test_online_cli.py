"""The online algorithms through the CLI on the micro model: every algorithm runs and logs its metrics,
LoRA policies save adapters alone with the LoRA base as reference, a trained reward model scores,
``alignkit generate`` writes completions, and bad input is one line naming the function, row or key."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from alignkit.data.synth import make_prompt_rows, write_rows
from tests.conftest import assert_ok, run_cli, write_config
from tests.integration.test_bad_input_cli import one_error_line


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    return write_rows(make_prompt_rows(24, seed=0), tmp_path / "prompts.jsonl")


def online_config(model: Path, prompts: Path, out: Path, algorithm: str = "grpo", **sections: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "algorithm": algorithm, "output_dir": str(out), "model": {"name_or_path": str(model)},
        "data": {"train": str(prompts), "max_length": 48},
        "rollout": {"num_generations": 4, "max_new_tokens": 4},
        "reward": {"functions": [{"name": "exact_match", "weight": 1.0}, {"name": "length", "weight": -0.1}]},
        "training": {"per_device_batch_size": 8, "learning_rate": 1e-4, "max_steps": 2},
        "logging": {"logging_steps": 1, "plot": False},
    }
    for name, value in sections.items():
        cfg.setdefault(name, {}).update(value)
    return cfg


def train(cfg: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return run_cli(["train", str(write_config(tmp_path / f"{cfg['algorithm']}.yaml", cfg))])


def rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("algorithm", ["grpo", "dr_grpo", "ppo_lag"])  # rloo and ppo: tests/distributed/test_online_rl.py
def test_online_algorithms_run_and_log(micro_model: Path, prompts: Path, tmp_path: Path, algorithm: str) -> None:
    out = tmp_path / "run"
    extra: dict[str, Any] = {"ppo_lag": {"cost_functions": [{"name": "length"}], "threshold": 0.5}}
    if algorithm == "dr_grpo":  # two PPO-style epochs per iteration: old log-probs computed, ratios clipped
        extra = {"rollout": {"update_epochs": 2}, "grpo": {"importance_sampling_level": "sequence"}}
    assert_ok(train(online_config(micro_model, prompts, out, algorithm, **extra), tmp_path))
    logged = rows(out)
    # one log row per iteration: two optimizer steps each with update_epochs 2
    assert [r["step"] for r in logged] == ([2] if algorithm == "dr_grpo" else [1, 2])
    assert all(r["loss"] == r["loss"] for r in logged)  # finite
    for key in ("loss", "reward_mean", "reward/exact_match", "reward/length", "completion_length", "clip_fraction",
                "entropy", "gen_tokens_per_s", "train_tokens_per_s", "rollout_s", "update_s", "time/generate_s",
                "time/score_s", "time/gather_s", "time/experience_s", "time/update_s"):
        assert key in logged[-1], (key, sorted(logged[-1]))
    if algorithm.startswith("ppo"):
        assert "kl" in logged[-1] and "value_loss" in logged[-1] and "grad_norm/value" in logged[-1]
        assert (out / "final_value" / "model.safetensors").is_file()
    if algorithm == "ppo_lag":
        assert logged[-1]["lambda"] > 1.0 and "J_C" in logged[-1]  # ~2-4 words cost > 0.5: lambda rises
        assert (out / "final_cost_value").is_dir()
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and {"step", "prompt", "completion"} <= set(samples[0])
    assert (out / "final" / "model.safetensors").is_file()


def test_grpo_mini_batches_keep_the_samplers_log_probs_for_the_later_steps(micro_model: Path, prompts: Path,
                                                                          tmp_path: Path) -> None:
    """rollout.mini_batches 2 at update_epochs 1: two optimizer steps per iteration over disjoint halves; the second
    half is scored against the log-probs of the policy that sampled it (not the moved one's, detached: ratio 1), so
    at a tiny clip range its tokens are clipped."""
    out = tmp_path / "run"
    cfg = online_config(micro_model, prompts, out, "grpo", rollout={"mini_batches": 2}, grpo={"epsilon": 1e-6},
                        training={"learning_rate": 1e-3, "max_steps": 4})
    proc = train(cfg, tmp_path)
    assert_ok(proc)
    assert "4 steps in all (2 per iteration)" in proc.stdout + proc.stderr
    logged = rows(out)
    assert [r["step"] for r in logged] == [2, 4]
    assert all(r["clip_fraction"] > 0 for r in logged), logged


def test_lora_policy_with_kl_saves_adapters_alone(micro_model: Path, prompts: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = online_config(micro_model, prompts, out, grpo={"beta": 0.1})
    cfg["model"]["lora"] = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    proc = train(cfg, tmp_path)
    assert_ok(proc)
    assert "LoRA enabled for policy model" in proc.stdout + proc.stderr
    assert (out / "final" / "adapter_model.safetensors").is_file() and not (out / "final" / "model.safetensors").exists()
    assert all(r["kl"] >= 0 for r in rows(out))  # k3 against the LoRA base (adapters off)


def test_reward_model_scores_completions(micro_model: Path, prompts: Path, tmp_path: Path) -> None:
    """A scalar model by path is a frozen ``reward`` role; its score joins the functions (weight)."""
    from alignkit.models.scalar import load_scalar_model
    from alignkit.config.schema import ModelConfig

    rm = tmp_path / "rm"
    load_scalar_model(ModelConfig(name_or_path=str(micro_model)), trainable=False).save_pretrained(rm)
    for f in micro_model.glob("tokenizer*"):
        (rm / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "run"
    cfg = online_config(micro_model, prompts, out, reward={"functions": [], "model": str(rm), "model_weight": 2.0})
    assert_ok(train(cfg, tmp_path))
    last = rows(out)[-1]
    assert abs(last["reward_mean"] - 2.0 * last["reward/model"]) < 1e-6


def test_generate_command(micro_model: Path, prompts: Path, tmp_path: Path) -> None:
    out = tmp_path / "gen.jsonl"
    proc = run_cli(["generate", str(micro_model), str(prompts), "--out", str(out), "--max-new-tokens", "3",
                    "--num-generations", "2", "--temperature", "1", "--reward", "exact_match"])
    assert_ok(proc)
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(got) == 24 and len(got[0]["completions"]) == 2 and len(got[0]["scores"]) == 2
    assert "exact_match: mean" in proc.stderr


def test_bad_reward_function_names_it(micro_model: Path, prompts: Path, tmp_path: Path) -> None:
    (tmp_path / "my_rewards.py").write_text(
        "def short(prompts, completions, **kw):\n    return [1.0]\n"
        "def boom(prompts, completions, **kw):\n    raise ValueError('no answer field')\n")
    for fn, expected in (("short", "returned 1 values for 8 completions"), ("boom", "raised ValueError: no answer field")):
        cfg = online_config(micro_model, prompts, tmp_path / fn, reward={"functions": [{"name": f"my_rewards:{fn}"}]})
        proc = run_cli(["train", str(write_config(tmp_path / f"{fn}.yaml", cfg))], cwd=tmp_path)
        line = one_error_line(proc)
        assert f"reward function 'my_rewards:{fn}'" in line and expected in line, line
    cfg = online_config(micro_model, prompts, tmp_path / "x", reward={"functions": [{"name": "exact_mach"}]})
    line = one_error_line(train(cfg, tmp_path))
    assert "exact_mach" in line and "exact_match" in line


def test_prompt_rows_checked(micro_model: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "What is 1+1?"}) + "\n" + json.dumps({"question": "x"}) + "\n")
    line = one_error_line(train(online_config(micro_model, bad, tmp_path / "r"), tmp_path))
    assert f"{bad}:2" in line and "'prompt'" in line
    cfg = online_config(micro_model, bad, tmp_path / "r2")
    cfg["training"]["per_device_batch_size"] = 6  # 6 completions do not split into groups of 4
    line = one_error_line(train(cfg, tmp_path))
    assert "rollout.num_generations" in line
