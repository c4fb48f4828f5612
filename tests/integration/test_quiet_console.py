"""The training log says alignkit's lines only: no transformers progress bars on load or save, no
LOAD REPORT table (one alignkit line instead), no deprecation warnings that users cannot act on."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from tests.conftest import assert_ok, run_cli, write_config

#: library output that must never reach a training log
NOISE = ("Loading weights", "Writing model shards", "LOAD REPORT", "UNEXPECTED", "is_gradient_checkpointing",
         "broadcast_buffers", "\x1b[")
HEAD_LINE = "Reward/cost model: score head initialised fresh; LM head dropped"


def assert_quiet(log: str) -> None:
    found = [n for n in NOISE if n in log]
    assert not found, f"{found} in:\n{log[-4000:]}"


def test_sft_lora_and_reward_model_logs_hold_no_library_noise(sft_config: dict[str, Any], micro_model: Path,
                                                              tmp_path: Path) -> None:
    # SFT with LoRA + gradient checkpointing (peft reads the deprecated property), a checkpoint and a final save
    sft = copy.deepcopy(sft_config)
    sft["model"].update(lora={"r": 4}, gradient_checkpointing=True)
    sft["training"]["max_steps"] = 2
    sft["checkpoint"] = {"save_steps": 1, "save_final": True}
    sft["logging"]["report_to"] = ["console"]
    proc = run_cli(["train", str(write_config(tmp_path / "sft.yaml", sft))])
    assert_ok(proc)
    assert_quiet(proc.stdout + proc.stderr)
    assert "Saved final model" in proc.stderr
    # a reward model built from the causal LM: fresh score head, unused LM head, full-weight save
    rm = {"algorithm": "reward_model", "output_dir": str(tmp_path / "rm"), "model": {"name_or_path": str(micro_model)},
          "data": {"train": "builtin:safety_train.jsonl", "max_length": 96, "max_train_examples": 8},
          "training": {"per_device_batch_size": 4, "max_steps": 1}, "logging": {"report_to": ["console"]}}
    proc = run_cli(["train", str(write_config(tmp_path / "rm.yaml", rm))])
    assert_ok(proc)
    assert_quiet(proc.stdout + proc.stderr)
    assert proc.stderr.count(HEAD_LINE) == 1
    assert (tmp_path / "rm" / "final" / "model.safetensors").is_file()
