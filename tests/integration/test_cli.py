"""The CLI end to end: tiny-model, train on a shipped config (alone and under torchrun), crash safety."""

from __future__ import annotations

import json
import re
import signal
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO, assert_ok, run_cli, write_config


@pytest.fixture(scope="module")
def cli_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "tiny-model"
    proc = run_cli(["tiny-model", str(out), "--size", "micro"])
    assert_ok(proc)
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert list(out.glob("*.safetensors"))
    return out


def shipped(cli_model: Path, out: Path, *extra: str) -> list[str]:
    return ["train", str(REPO / "configs" / "sft.yaml"), f"model.name_or_path={cli_model}", f"output_dir={out}",
            "data.max_train_examples=64", "data.max_eval_examples=20", "training.max_steps=4",
            "training.per_device_batch_size=4", "training.eval_steps=2", "checkpoint.save_steps=2",
            "logging.logging_steps=1", "logging.report_to=[console,jsonl,tensorboard]", *extra]


def test_train_shipped_config_single_process(cli_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_cli(shipped(cli_model, out))
    assert_ok(proc)
    assert "Effective batch size: 4 (per_device=4 x accumulation=1 x 1 processes)" in proc.stderr
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
    for key in ("step", "epoch", "loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_mb"):
        assert key in train_rows[0], key
    assert any("eval/loss" in r for r in rows)
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "config.yaml").is_file() and (out / "final" / "model.safetensors").is_file()
    # save_total_limit: 2 keeps the two newest checkpoints; latest names the newest
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert (out / "latest").read_text() == "checkpoint-4"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "final")


def test_train_under_torchrun_two_processes(cli_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = run_cli(shipped(cli_model, out, "training.per_device_batch_size=2",
                           "training.gradient_accumulation_steps=2"), nproc=2)
    assert_ok(proc)
    assert "Distributed training initialized: world_size=2 backend=gloo" in proc.stderr
    assert "Effective batch size: 8 (per_device=2 x accumulation=2 x 2 processes)" in proc.stderr
    # rank 0 alone logs: each step line appears once
    assert len(re.findall(r"step 1 loss=", proc.stderr)) == 1
    assert (out / "final" / "model.safetensors").is_file()
    # the untrained eval, once, over both ranks' shares: equal to one process evaluating every example
    from alignkit.cli.eval_command import run_eval
    from alignkit.config import load_config

    zero = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"step": 0' in x]
    assert len(zero) == 1 and len(re.findall(r"step 0 eval/loss=", proc.stderr)) == 1
    one = run_eval(load_config(REPO / "configs" / "sft.yaml", shipped(cli_model, tmp_path / "one")[2:]), show=False)
    assert zero[0]["eval/loss"] == pytest.approx(one["loss"], rel=1e-5)


def test_python_dash_m_matches_console_script(tmp_path: Path) -> None:
    proc = run_cli(["--help"])
    assert_ok(proc)
    assert "train" in proc.stdout and "validate" in proc.stdout and "tiny-model" in proc.stdout


def test_kill9_during_checkpoint_leaves_previous_loadable(cli_model: Path, tmp_path: Path) -> None:
    """SIGKILL while checkpoint-2 is half written: checkpoint-1 stays whole, latest points at it,
    and a resumed run cleans the debris and finishes."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "c.yaml", {
        "algorithm": "sft", "output_dir": str(out), "model": {"name_or_path": str(cli_model)},
        "data": {"train": "builtin:sft_train.jsonl", "max_train_examples": 32, "max_length": 64},
        "training": {"per_device_batch_size": 4, "max_steps": 3, "learning_rate": 1e-3},
        "checkpoint": {"save_steps": 1}, "logging": {"report_to": ["jsonl"]},
    })
    prelude = textwrap.dedent("""
        import os, signal
        from alignkit.distributed.strategy import base
        real = base.Strategy.save_training_state
        calls = []
        def crashing(self, handle, out_dir):
            calls.append(out_dir)
            if len(calls) == 2:  # the second checkpoint: model written, optimizer half written
                (out_dir / "optimizer.pt").write_bytes(b"half")
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, handle, out_dir)
        base.Strategy.save_training_state = crashing
    """)
    proc = run_cli(["train", str(cfg)], prelude=prelude)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert (out / "latest").read_text() == "checkpoint-1"
    assert (out / ".tmp-checkpoint-2").is_dir() and not (out / "checkpoint-2").exists()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "checkpoint-1" / "policy")
    import torch

    torch.load(out / "checkpoint-1" / "policy" / "optimizer.pt", weights_only=True)
    resumed = run_cli(["train", str(cfg), "checkpoint.resume_from=latest"])
    assert_ok(resumed)
    assert "Resumed from" in resumed.stderr and "checkpoint-1 at step 1" in resumed.stderr
    assert not (out / ".tmp-checkpoint-2").exists()
    assert (out / "latest").read_text() == "checkpoint-3"


def test_demo_smoke(tmp_path: Path) -> None:
    """``alignkit demo`` (the README's first command), shortened: builds its model, trains, judges."""
    out = tmp_path / "demo"
    proc = run_cli(["demo", "--output-dir", str(out), "--size", "micro", "--max-steps", "3"])
    assert_ok(proc)
    text = proc.stdout
    assert "alignkit demo: SFT of a random" in text
    for line in ("train loss (first step -> last step)", "held-out loss", "held-out accuracy (greedy, judged)",
                 "held-out accuracy/add (greedy, judged)"):
        assert line in text, line
    rows = [json.loads(x) for x in (out / "sft" / "metrics.jsonl").read_text().splitlines()]
    # its curves start where training starts: the untrained eval at step 0, the first step's loss
    assert [r["step"] for r in rows if "loss" in r] == [1, 3] and [r["step"] for r in rows if "eval/loss" in r] == [0, 3]
    before = next(line for line in text.splitlines() if line.startswith("held-out loss")).split()[-2]
    assert before == f"{rows[0]['eval/loss']:.3f}"  # the demo's "before" is the run's step-0 eval
    assert (out / "sft" / "final" / "model.safetensors").is_file()
    assert (out / "model-micro" / "tokenizer.json").is_file()
