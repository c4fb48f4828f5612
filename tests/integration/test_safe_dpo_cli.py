"""safe_dpo from the CLI: the seed surface of a short run (step line, start-up lines, epoch_N/ saves,
JSONL keys), an exact resume of lambda and J_C from a step checkpoint, and LoRA epoch saves holding the
adapter alone."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO, assert_ok, run_cli
from tests.safe_dpo_models import make_scorers
from tests.unit.algorithms.test_safe_dpo_algorithm import overrides

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def scorers(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_scorers(micro_model, tmp_path_factory.mktemp("scorers"))


def _jsonl(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_cli_run_surface_and_exact_resume(micro_model: Path, scorers, tmp_path: Path) -> None:
    config = str(REPO / "configs" / "safe_dpo.yaml")
    full = tmp_path / "full"
    proc = run_cli(["train", config, *overrides(micro_model, scorers, full)], timeout=600)
    assert_ok(proc)
    assert re.search(r"^Epoch 1 step 2 loss_H=\d\.\d{4} loss_S=\d\.\d{4} KL=\S+ lambda=\d+\.\d{4} ", proc.stderr, re.M)
    assert re.search(r"^Epoch 2 step 8 loss_H=", proc.stderr, re.M)
    assert "Effective batch size: 4" in proc.stderr and "kept loaded for the on-policy J_C estimate" in proc.stderr
    for d in ("epoch_1", "epoch_2", "final", "checkpoint-4", "checkpoint-8"):
        assert (full / d).is_dir(), d
    assert (full / "epoch_1" / "model.safetensors").is_file()
    rows = [r for r in _jsonl(full) if "loss_H" in r]
    assert all(k in rows[-1] for k in ("loss_H", "loss_S", "lambda", "J_C", "KL"))
    lambdas = [r["lambda"] for r in rows]
    assert lambdas == sorted(lambdas) and lambdas[-1] > lambdas[0]  # J_C > threshold: lambda rises
    # resume from checkpoint-4 in a copy of the run: the multiplier continues exactly
    part = tmp_path / "part"
    shutil.copytree(full, part, ignore=shutil.ignore_patterns("checkpoint-8", "epoch_2", "final"))
    (part / "latest").unlink(missing_ok=True)
    proc = run_cli(["train", config, *overrides(micro_model, scorers, part), f"checkpoint.resume_from={part / 'checkpoint-4'}"],
                   timeout=600)
    assert_ok(proc)
    assert "Resumed from" in proc.stderr
    want = {r["step"]: (r["lambda"], r["J_C"]) for r in _jsonl(full) if "lambda" in r}
    got = {r["step"]: (r["lambda"], r["J_C"]) for r in _jsonl(part) if "lambda" in r}
    assert got == want


def test_lora_epoch_saves_hold_the_adapter_alone(micro_model: Path, scorers, tmp_path: Path) -> None:
    out = tmp_path / "lora"
    over = overrides(micro_model, scorers, out) + ["data.max_train_examples=8", "checkpoint.save_steps=null",
                                                   "model.lora.dropout=0.0"]
    proc = run_cli(["train", str(REPO / "configs" / "safe_dpo_lora.yaml"), *over], timeout=600)
    assert_ok(proc)
    assert "LoRA enabled for policy model:" in proc.stderr
    assert "Precomputed reference log-probs (lora_base)" in proc.stderr
    for d in ("epoch_1", "epoch_2", "final"):
        assert (out / d / "adapter_config.json").is_file(), d
        assert not (out / d / "model.safetensors").exists(), d
