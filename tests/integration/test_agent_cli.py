"""grpo_agent through the CLI (issue 48, C): a run resumed from its iteration-2 checkpoint continues exactly (the
same losses, gradient norms and final weights as the straight run: the environment keeps nothing between
iterations, the prompt order and the optimizer come back from the checkpoint). The scripted agent engine
(tests/plugins/scripted_agent_engine.py) makes the trajectories nonzero-advantage and sampling-free."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import assert_ok, child_env, run_cli, write_config

pytestmark = pytest.mark.slow


def config(micro_model: Path, out: Path, **checkpoint: object) -> Path:
    cfg = {"algorithm": "grpo_agent", "output_dir": str(out), "plugins": ["tests.plugins.scripted_agent_engine"],
           "model": {"name_or_path": str(micro_model)},
           "data": {"train": "builtin:calculator_prompts_train.jsonl", "max_length": 200},
           "rollout": {"engine": "scripted_agent", "num_generations": 4, "max_new_tokens": 72},
           "agent": {"max_turns": 3, "max_total_tokens": 128},
           "grpo": {"loss_aggregation": "token_mean"},
           "training": {"per_device_batch_size": 8, "max_steps": 4, "learning_rate": 1e-3, "seed": 0},
           "logging": {"logging_steps": 1, "plot": False}, "checkpoint": {"save_steps": 2, **checkpoint}}
    return write_config(out.parent / f"{out.name}.yaml", cfg)


def logged(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


@pytest.fixture(scope="module")
def straight(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run (4 iterations, checkpoints at 2 and 4) both resume tests compare with."""
    out = tmp_path_factory.mktemp("agent") / "straight"
    assert_ok(run_cli(["train", str(config(micro_model, out))]))
    return out


def final_weights(run: Path) -> dict:
    return load_file(str(run / "final" / "model.safetensors"))


def test_resume_is_exact(micro_model: Path, tmp_path: Path, straight: Path) -> None:
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    (resumed / "latest").write_text("checkpoint-2")
    assert_ok(run_cli(["train", str(config(micro_model, resumed, resume_from="latest"))]))
    a, b = logged(straight), logged(resumed)
    assert sorted(b) == [3, 4]
    for step in (3, 4):
        assert a[step]["loss"] != 0.0 and a[step]["reward_mean"] == 0.5
        for key in ("loss", "grad_norm", "entropy", "reward_mean", "advantage_std", "agent/turns"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-6, abs=1e-9), key
    wa, wb = final_weights(straight), final_weights(resumed)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 1e-6


def test_sigkill_after_a_checkpoint_then_resume_finishes(micro_model: Path, tmp_path: Path, straight: Path) -> None:
    """A grpo_agent run killed with SIGKILL once its first checkpoint is written resumes from ``latest`` and
    finishes: every step logged once, the final weights those of the uninterrupted run (a crash test of the
    newest features: the kill lands anywhere after checkpoint-1, in a rollout, an update or a later save)."""
    out = tmp_path / "killed"
    cfg = config(micro_model, out, save_steps=1, resume_from="latest")
    proc = subprocess.Popen([sys.executable, "-m", "alignkit", "train", str(cfg)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=child_env())
    deadline = time.monotonic() + 120
    while not (out / "latest").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "final").exists(), "the run ended before it was killed"
    assert_ok(run_cli(["train", str(cfg)]))
    steps = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == [1, 2, 3, 4]
    wa, wb = final_weights(straight), final_weights(out)
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 1e-6


def ppo_config(micro_model: Path, out: Path) -> dict:
    """The scripted ``ppo_agent`` run (2 iterations of 4 trajectories) the smoke, 2-process and separate-placement
    tests share."""
    return {"algorithm": "ppo_agent", "output_dir": str(out), "plugins": ["tests.plugins.scripted_agent_engine"],
            "model": {"name_or_path": str(micro_model)},
            "data": {"train": "builtin:calculator_prompts_train.jsonl", "max_length": 200},
            "rollout": {"engine": "scripted_agent", "num_generations": 2, "max_new_tokens": 72},
            "agent": {"max_turns": 3, "max_total_tokens": 128},
            "ppo": {"kl_coef": 0.05, "vf_coef": 0.1},
            "training": {"per_device_batch_size": 4, "max_steps": 2, "learning_rate": 1e-3, "seed": 0},
            "logging": {"logging_steps": 1, "plot": False}, "checkpoint": {"save_final": False}}


def test_ppo_agent_smoke(micro_model: Path, tmp_path: Path) -> None:
    """``algorithm: ppo_agent`` (issue 48, C): the agent rollout with PPO's critic; the value head trains on the
    policy's ids, the logged advantages are GAE's (whitened: nonzero), the agent metrics are there."""
    out = tmp_path / "ppo"
    assert_ok(run_cli(["train", str(write_config(tmp_path / "ppo.yaml", ppo_config(micro_model, out)))]))
    rows = logged(out)
    assert sorted(rows) == [1, 2]
    for r in rows.values():
        assert r["reward_mean"] == 0.5 and r["agent/turns"] == 1.5 and r["agent/tool_valid"] == 1.0
        assert r["value_loss"] > 0 and r["loss"] == r["loss"] and r["reward_advantage_std_raw"] > 0
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["advantage"] != 0.0 for s in samples)
