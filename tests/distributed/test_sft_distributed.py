"""Distributed properties of the offline loop (2 processes over gloo, on CPU).

- DDP == single process, and gradient-accumulation invariance: 1x4, 1x1 (accumulation 4),
  2 ranks x 2 and 2 ranks x 1 (accumulation 2) reach the same parameters, on batches whose
  examples have different numbers of loss tokens, through padded and packed layouts alike.
- Exact resume, in one process and in two.
- Identical statistics on every rank, and evaluation that sees each example once.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import assert_ok, run_cli, run_script, write_config
from tests.distributed.runs import derive_config

pytestmark = pytest.mark.distributed

WORKERS = Path(__file__).parent / "workers"


def configure(cfg: dict[str, Any], tmp: Path, name: str, **over: Any) -> Path:
    """``cfg`` with ``over`` (``section__key=value``), output in ``tmp/name``, written to ``tmp/name.yaml``."""
    return write_config(tmp / f"{name}.yaml", derive_config(cfg, tmp / name, **over))


def train(cfg: dict[str, Any], tmp: Path, name: str, nproc: int = 1, **over: Any) -> Path:
    proc = run_cli(["train", str(configure(cfg, tmp, name, **over))], nproc=nproc)
    assert_ok(proc)
    return tmp / name


def train_two_processes(cfg: dict[str, Any], tmp: Path, runs: dict[str, dict[str, Any]]) -> dict[str, Path]:
    """Each of ``runs`` (name: overrides) on 2 processes, one after another in ONE torchrun launch
    (workers/train_many.py: a launch costs ~10 s of process start and imports, more than these runs)."""
    paths = [str(configure(cfg, tmp, name, **over)) for name, over in runs.items()]
    assert_ok(run_script(WORKERS / "train_many.py", nproc=2, args=paths, timeout=400))
    return {name: tmp / name for name in runs}


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "model.safetensors"))


def losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float, what: str = "") -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, f"{what}: max |delta| = {worst:.3g} > {atol}"


@pytest.fixture
def base(sft_config: dict[str, Any]) -> dict[str, Any]:
    cfg = copy.deepcopy(sft_config)
    # AdamW's first steps move a coordinate by ~lr * g / (|g| + eps): where |g| is near eps
    # (a few SiLU-gate weights), fp32 summation-order noise in g (1e-9) becomes a 1e-5 weight
    # difference. eps=1e-6 keeps the comparison about the gradients, not Adam's division.
    cfg["training"].update({"max_steps": 3, "learning_rate": 2e-3, "max_grad_norm": 1.0, "adam_epsilon": 1e-6})
    cfg["data"]["max_train_examples"] = 48
    cfg["checkpoint"] = {"save_final": True}
    return cfg


def test_ddp_equals_single_and_accumulation_invariance(base: dict[str, Any], tmp_path: Path) -> None:
    ref = train(base, tmp_path, "1x4", training__per_device_batch_size=4, data__packing=False)
    runs = {
        "1x1_ga4_packed": train(base, tmp_path, "1x1ga4", training__per_device_batch_size=1,
                                training__gradient_accumulation_steps=4, data__packing=True),
        **train_two_processes(base, tmp_path, {
            "2x2_packed": {"training__per_device_batch_size": 2, "data__packing": True},
            # training.fused_layers under DDP equals the plain single-process run too
            "2x2_packed_fused": {"training__per_device_batch_size": 2, "data__packing": True,
                                 "training__fused_layers": True},
            "2x1_ga2": {"training__per_device_batch_size": 1, "training__gradient_accumulation_steps": 2,
                        "data__packing": False},
            "global_batch": {"training__per_device_batch_size": None, "training__global_batch_size": 4},
        }),
    }
    w_ref, l_ref = weights(ref), losses(ref)
    assert len(l_ref) == 3
    # the steps' examples really differ in their number of loss tokens (else this proves little)
    for name, run in runs.items():
        assert_same_weights(w_ref, weights(run), atol=1e-5, what=name)
        assert losses(run) == pytest.approx(l_ref, abs=1e-5), name
    # and training moved the weights at all
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(base["model"]["name_or_path"]).state_dict()
    assert max((start[k] - w_ref[k]).abs().max().item() for k in w_ref) > 1e-3  # >> the 1e-5 tolerance


@pytest.mark.parametrize("nproc", [1, 2])
def test_exact_resume(base: dict[str, Any], tmp_path: Path, nproc: int) -> None:
    per_device = 4 // nproc
    over = {"training__max_steps": 6, "training__per_device_batch_size": per_device,
            "training__lr_scheduler": "cosine", "training__warmup_steps": 2, "checkpoint__save_steps": 3,
            "checkpoint__save_final": True}
    # "stop after 3 steps": a run into a fresh output dir resumed from the straight run's step-3 checkpoint; on 2
    # processes both runs share one torchrun launch (the second starts after the first has saved)
    runs = {"straight": over, "resumed": {**over, "checkpoint__resume_from": str(tmp_path / "straight" / "checkpoint-3")}}
    if nproc == 1:
        straight, resumed = [train(base, tmp_path, name, **o) for name, o in runs.items()]
    else:
        straight, resumed = train_two_processes(base, tmp_path, runs).values()
    assert (straight / "checkpoint-3" / "trainer_state.json").is_file() and not (resumed / "checkpoint-3").exists()
    assert_same_weights(weights(straight), weights(resumed), atol=0.0 if nproc == 1 else 1e-6)
    assert losses(resumed) == pytest.approx(losses(straight)[3:], abs=0.0 if nproc == 1 else 1e-6)


def test_statistics_identical_on_every_rank() -> None:
    proc = run_script(WORKERS / "comm_worker.py", nproc=2)
    assert_ok(proc)
    assert "comm checks passed on rank 0" in proc.stdout
