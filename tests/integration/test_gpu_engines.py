"""On a CUDA device (skipped without one; CI has none): the steady-state step never syncs with the host
beyond its one read-back, gradient checkpointing gives the same losses, FSDP2 and DeepSpeed ZeRO-2/3 with one
rank over NCCL save and resume exactly, and the start-up log prints the GPU memory line (issue 38, item 8)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import assert_ok, run_cli, write_config
from tests.integration.test_gpu_steps import assert_one_sync_per_step, synced_steps

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def losses_of(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and "eval/loss" not in r}


def gpu_config(sft_config: dict[str, Any], tmp_path: Path, name: str, **training: Any) -> Path:
    cfg = json.loads(json.dumps(sft_config))
    cfg["output_dir"] = str(tmp_path / name)
    cfg["data"]["packing"] = True
    cfg["training"].update({"max_steps": 6, **training})
    cfg["logging"] = {"logging_steps": 1, "report_to": ["jsonl"], "plot": False}
    return write_config(tmp_path / f"{name}.yaml", cfg)


@pytest.mark.parametrize("algo", ["sft", "dpo"])
def test_steady_state_steps_do_not_sync(monkeypatch, micro_model: Path, sft_config: dict, tmp_path: Path,
                                        algo: str) -> None:
    """torch.cuda.set_sync_debug_mode warns at every synchronising CUDA call; steps 3+ may warn at most once
    each (the step's read-back of its losses and gradient norms). A failure lists each call's Python line and
    the op (``test_gpu_steps.synced_steps``), and the packed row's attention kernel."""
    from alignkit.models import attention

    print(attention.describe("auto", torch.device("cuda")))
    if algo == "sft":
        steps = synced_steps(monkeypatch, gpu_config(sft_config, tmp_path, "sft"), ["logging.logging_steps=100"])
    else:
        steps = synced_steps(monkeypatch, "dpo.yaml", [
            f"model.name_or_path={micro_model}", f"output_dir={tmp_path / 'dpo'}", "data.max_train_examples=32",
            "data.max_length=64", "training.per_device_batch_size=4", "training.max_steps=5", "training.eval_steps=null",
            "logging.logging_steps=100", "logging.report_to=[]", "checkpoint.save_final=false"])
    assert_one_sync_per_step(steps)


def test_gradient_checkpointing_same_losses(sft_config: dict, tmp_path: Path) -> None:
    plain = gpu_config(sft_config, tmp_path, "plain")
    for name, extra in (("plain", []), ("gc", ["model.gradient_checkpointing=true"])):
        assert_ok(run_cli(["train", str(plain), f"output_dir={tmp_path / name}", *extra]))
    a, b = losses_of(tmp_path / "plain"), losses_of(tmp_path / "gc")
    assert a.keys() == b.keys()
    for step in a:
        assert abs(a[step] - b[step]) <= 2e-2 * max(1.0, abs(a[step])), (step, a[step], b[step])


@pytest.mark.parametrize("engine", ["fsdp", "zero2", "zero3"])
def test_one_rank_nccl_save_and_exact_resume(sft_config: dict, tmp_path: Path, engine: str) -> None:
    """One rank over NCCL: 6 steps straight equal 4 steps, a checkpoint, and a resumed run's steps 5-6."""
    if engine != "fsdp":
        pytest.importorskip("deepspeed")
    pick = {"fsdp": ["distributed.strategy=fsdp"],
            "zero2": ["distributed.strategy=deepspeed", "distributed.deepspeed.zero_stage=2"],
            "zero3": ["distributed.strategy=deepspeed", "distributed.deepspeed.zero_stage=3"]}[engine]
    cfg = gpu_config(sft_config, tmp_path, engine)
    straight, split = tmp_path / "straight", tmp_path / "split"
    launch = ["launch", "--nproc-per-node", "1", str(cfg), *pick, "checkpoint.save_steps=4"]
    assert_ok(run_cli([*launch, f"output_dir={straight}"], timeout=600))
    assert_ok(run_cli([*launch, f"output_dir={split}", "training.max_steps=4"], timeout=600))
    assert_ok(run_cli([*launch, f"output_dir={split}", "checkpoint.resume_from=latest"], timeout=600))
    a, b = losses_of(straight), losses_of(split)
    for step in (5, 6):
        assert abs(a[step] - b[step]) <= 1e-3 * max(1.0, abs(a[step])), (step, a[step], b[step])


def test_startup_log_prints_the_gpu_memory_line(sft_config: dict, tmp_path: Path) -> None:
    proc = run_cli(["train", str(gpu_config(sft_config, tmp_path, "mem")), "training.max_steps=1"])
    assert_ok(proc)
    assert "GPU memory allocated:" in proc.stderr + proc.stdout
