"""vlm_sft over 2 gloo processes: DDP == FSDP2 == one process (same final weights) for the sft stage with a frozen
vision tower, padded on one side and packed on the other; the frozen parts are saved untouched; image DPO under DDP
and ZeRO-2/3, and text-only micro-batches under DDP, equal one process (every 2-process run of the file shares one
torchrun launch); and the seed guides' `bash scripts/train_multi_gpu.sh configs/vlm_pretrain.yaml pretrain` runs
the shipped config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from alignkit.data.synth_vlm import generate_vlm
from alignkit.models.vlm import part_of
from tests.conftest import REPO, assert_ok, child_env, free_port, run_cli, run_script, write_config
from tests.distributed.runs import derive_config, final_weights, max_delta

pytestmark = pytest.mark.distributed

WORKERS = Path(__file__).parent / "workers"


@pytest.fixture(scope="module")
def shapes_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shapes")
    generate_vlm(16, 0, root / "sft.json", stage="sft", split="train")
    generate_vlm(16, 0, root / "pretrain.json", stage="pretrain", split="train")
    return root


def _sft_configs(micro_llava: Path, shapes_dir: Path, root: Path) -> dict[str, Path]:
    """vlm_sft, 3 steps of 4 rows: one process (padded), DDP (packed) and FSDP2 (padded)."""
    base: dict[str, Any] = {
        "algorithm": "vlm_sft", "vlm": {"stage": "sft"}, "model": {"name_or_path": str(micro_llava)},
        "data": {"train": str(shapes_dir / "sft.json"), "max_length": 160},
        # eps=1e-6: see test_sft_distributed (Adam's division amplifies fp32 summation-order noise)
        "training": {"global_batch_size": 4, "learning_rate": 2e-3, "max_steps": 3, "lr_scheduler": "constant",
                     "adam_epsilon": 1e-6, "seed": 0},
        "logging": {"logging_steps": 1, "report_to": ["jsonl"], "plot": False},
    }
    return {name: write_config(root / f"{name}.yaml", derive_config(base, root / name, data__packing=packed,
                                                                     distributed__strategy=name))
            for name, packed in (("single", False), ("ddp", True), ("fsdp", False))}


def _image_dpo_configs(micro_llava: Path, root: Path) -> dict[str, Path]:
    """DPO on image + text preference rows (frozen reference with images): one process, DDP, ZeRO-2, ZeRO-3."""
    rows = generate_vlm(16, 0, root / "pairs.jsonl", stage="preference", split="train")
    base: dict[str, Any] = {
        "algorithm": "dpo", "model": {"name_or_path": str(micro_llava)},
        "data": {"train": str(rows), "max_length": 128},
        "training": {"global_batch_size": 4, "learning_rate": 2e-3, "max_steps": 3, "lr_scheduler": "constant",
                     "adam_epsilon": 1e-6, "seed": 0, "max_grad_norm": 0.0},
        "logging": {"logging_steps": 1, "report_to": ["jsonl"], "plot": False},
    }
    return {name: write_config(root / f"{name}.yaml", derive_config(base, root / name, distributed=strategy))
            for name, strategy in (("single", {"strategy": "single"}), ("ddp", {"strategy": "ddp"}),
                                   ("zero2", {"strategy": "deepspeed", "deepspeed": {"zero_stage": 2}}),
                                   ("zero3", {"strategy": "deepspeed", "deepspeed": {"zero_stage": 3}}))}


def _text_only_configs(micro_llava: Path, root: Path) -> dict[str, Path]:
    """DPO on rows with and without images (every other row's image removed), one row per micro-batch, 2 rows a
    step: one process with 2 accumulation steps, DDP with 1."""
    import json

    rows = generate_vlm(8, 0, root / "pairs.jsonl", stage="preference", split="train")
    mixed = [json.loads(line) for line in rows.read_text().splitlines()]
    for r in mixed[1::2]:
        del r["image"]
    rows.write_text("".join(json.dumps(r) + "\n" for r in mixed))
    base: dict[str, Any] = {
        "algorithm": "dpo", "model": {"name_or_path": str(micro_llava)},
        "data": {"train": str(rows), "max_length": 128},
        "training": {"per_device_batch_size": 1, "learning_rate": 2e-3, "max_steps": 4,
                     "lr_scheduler": "constant", "adam_epsilon": 1e-6, "seed": 0, "max_grad_norm": 0.0},
        "logging": {"logging_steps": 1, "report_to": ["jsonl"], "plot": False},
    }
    return {name: write_config(root / f"{name}.yaml", derive_config(
        base, root / name, distributed={"strategy": name}, training__gradient_accumulation_steps=3 - nproc))
        for name, nproc in (("single", 1), ("ddp", 2))}


@pytest.fixture(scope="module")
def runs(micro_llava: Path, shapes_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The three tests' runs, each under ``root/<test>/<name>``: the one-process ones as CLI children, every
    2-process one in ONE torchrun launch (workers/train_many.py: a launch's start-up costs more than a run).
    ``{"root": Path, "proc": the launch, "single": the vlm_sft one-process run}``."""
    root = tmp_path_factory.mktemp("vlm-runs")
    configs = {"sft": _sft_configs(micro_llava, shapes_dir, _mkdir(root / "sft")),
               "image_dpo": _image_dpo_configs(micro_llava, _mkdir(root / "image_dpo")),
               "text_only": _text_only_configs(micro_llava, _mkdir(root / "text_only"))}
    single = {}
    for group, paths in configs.items():
        single[group] = run_cli(["train", str(paths.pop("single"))], timeout=600)
        assert_ok(single[group])
    proc = run_script(WORKERS / "train_many.py", nproc=2, timeout=900,
                      args=[str(p) for paths in configs.values() for p in paths.values()])
    assert_ok(proc)
    return {"root": root, "proc": proc, "single": single["sft"]}


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


def _weights(runs: dict[str, Any], group: str, *names: str) -> dict[str, dict[str, torch.Tensor]]:
    return {name: final_weights(runs["root"] / group / name) for name in names}


def test_ddp_vlm_equals_single_process(micro_llava: Path, runs: dict[str, Any]) -> None:
    """vlm_sft: DDP (packed rows) and FSDP2 give the one-process (padded) weights; the frozen vision tower is saved
    untouched."""
    w = _weights(runs, "sft", "single", "ddp", "fsdp")
    for proc in (runs["single"], runs["proc"]):
        assert "vision_tower frozen" in proc.stderr and "projector 8,320 trainable" in proc.stderr
    assert max_delta(w["single"], w["ddp"]) < 2e-5
    assert max_delta(w["single"], w["fsdp"]) < 2e-5
    start = load_file(str(micro_llava / "model.safetensors"))
    for k, v in w["ddp"].items():
        assert torch.equal(v, start[k]) == (part_of(k) == "vision_tower"), k


def test_train_multi_gpu_script_runs_the_shipped_pretrain_config(micro_llava: Path, shapes_dir: Path,
                                                                   tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    os.symlink(micro_llava, tmp_path / "runs" / "tiny-llava")
    (tmp_path / "runs" / "data").mkdir()
    os.symlink(shapes_dir, tmp_path / "runs" / "data" / "shapes")  # where configs/vlm_pretrain.yaml reads it
    env = child_env(PYTHON=sys.executable, MASTER_PORT=str(free_port()))
    proc = subprocess.run(["bash", str(REPO / "scripts" / "train_multi_gpu.sh"), str(REPO / "configs" / "vlm_pretrain.yaml"),
                           "pretrain", "2", "training.max_steps=2", "logging.plot=false"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path, check=False)
    assert_ok(proc)
    assert "VLM stage pretrain: vision_tower frozen" in proc.stderr and "Strategy: ddp" in proc.stderr
    final = tmp_path / "runs" / "vlm_pretrain" / "final"
    assert (final / "model.safetensors").is_file() and (final / "processor_config.json").is_file()


def test_image_dpo_under_ddp_and_deepspeed_equals_single_process(micro_llava: Path, runs: dict[str, Any]) -> None:
    """Image + text preference rows (DPO, frozen reference with images) over 2 processes: DDP and DeepSpeed
    ZeRO-2 / ZeRO-3 give the one-process weights; the vision tower stays untouched."""
    w = _weights(runs, "image_dpo", "single", "ddp", "zero2", "zero3")
    for name in ("ddp", "zero2", "zero3"):
        assert max_delta(w["single"], w[name]) < 2e-5, name
    start = load_file(str(micro_llava / "model.safetensors"))
    for k, v in w["zero3"].items():
        assert torch.equal(v, start[k]) == (part_of(k) == "vision_tower"), k


def test_text_only_micro_batches_of_a_vlm_under_ddp(runs: dict[str, Any]) -> None:
    """Rows with and without images, one row per micro-batch: a micro-batch without images must not leave the
    trained projector out of DDP's gradient reduction (it takes part with a zero gradient); DDP == one process."""
    w = _weights(runs, "text_only", "single", "ddp")
    assert max_delta(w["single"], w["ddp"]) < 2e-5
