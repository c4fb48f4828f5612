"""bf16 training on a CUDA GPU (skipped without one): an SFT step's loss is fp32's to bf16 round-off, and LoRA
on a bf16 base trains. The CPU half of the same contract (no float32 GEMM under bf16, fp32 math kept in fp32
runs) is ``tests/unit/rules/test_bf16_matmuls.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from alignkit.config import load_config
from alignkit.train.runner import run_train
from tests.conftest import write_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def sft_losses(sft_config: dict[str, Any], out: Path, dtype: str, **changes: Any) -> list[float]:
    """The logged loss of every optimizer step of an SFT run of ``sft_config`` in ``dtype``; ``changes``:
    top-level sections updated key by key (``training={...}``, ``model={...}``)."""
    cfg = dict(sft_config, output_dir=str(out))
    cfg["model"] = dict(cfg["model"], dtype=dtype)
    cfg["logging"] = dict(cfg["logging"], plot=False)
    for section, values in changes.items():
        cfg[section] = dict(cfg.get(section, {}), **values)
    run_train(load_config(write_config(out.with_suffix(".yaml"), cfg)))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_bf16_sft_step_close_to_fp32(sft_config: dict[str, Any], tmp_path: Path) -> None:
    fp32 = sft_losses(sft_config, tmp_path / "fp32", "fp32", training={"max_steps": 2})
    bf16 = sft_losses(sft_config, tmp_path / "bf16", "bf16", training={"max_steps": 2})
    assert len(fp32) == len(bf16) == 2
    # the same weights and batch: only bf16 GEMMs differ (~0.4% relative per product, averaged over tokens)
    assert bf16[0] == pytest.approx(fp32[0], rel=1e-2) and bf16[1] == pytest.approx(fp32[1], rel=2e-2)
    assert bf16 != fp32  # the run did compute in bf16


def test_lora_on_a_bf16_base_learns(sft_config: dict[str, Any], tmp_path: Path) -> None:
    """The frozen base is held in bf16 (``Strategy.policy_dtype``), the adapters in fp32; 32 steps of 8 rows
    bring the micro model's loss from ~6.8 to ~6.4 (measured on a CPU in bf16: -0.38 between the first and the
    last four steps)."""
    losses = sft_losses(sft_config, tmp_path / "lora", "bf16", model={"lora": {"r": 8, "alpha": 16, "dropout": 0.0}},
                        training={"max_steps": 32, "learning_rate": 1e-2, "per_device_batch_size": 8},
                        data={"max_train_examples": 32})
    assert len(losses) == 32 and all(x == x for x in losses), losses  # finite
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.2, losses


def test_bf16_compute_weights_match_autocast_on_cuda(sft_config: dict[str, Any], tmp_path: Path) -> None:
    """``model.compute_weights: cast`` (a bf16 copy of fp32 master weights) against ``autocast`` on CUDA: the same
    losses to bf16 round-off (on CPU: tests/unit/train/test_compute_weights.py, within 2.4e-4 over 8 steps)."""
    steps = {"max_steps": 3}
    autocast = sft_losses(sft_config, tmp_path / "autocast", "bf16", model={"compute_weights": "autocast"},
                          training=steps)
    cast = sft_losses(sft_config, tmp_path / "cast", "bf16", model={"compute_weights": "cast"}, training=steps)
    assert len(cast) == len(autocast) == 3
    assert cast == pytest.approx(autocast, rel=1e-2)
