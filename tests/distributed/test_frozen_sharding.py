"""A frozen DPO reference sharded (``distributed.shard_frozen``) under FSDP2 and DeepSpeed ZeRO-3, 2 gloo ranks.

ONE torchrun launch (``workers/frozen_sharding.py``) trains DPO with a separate frozen reference
(``dpo.reference: model``, online log-probs) for 3 steps, with an odd-sized evaluation (so the
ranks run different numbers of real eval batches): replicated vs sharded reference must give the
same losses, evaluation metrics and final weights; the sharded reference's parameters must really be
split over the ranks; ``auto`` must decide from the smallest device of all ranks. The DeepSpeed
runs are left out (and their tests skipped) when deepspeed is not importable.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from tests.conftest import assert_ok, run_script, write_config

pytestmark = pytest.mark.distributed

WORKERS = Path(__file__).parent / "workers"
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")

FSDP = {"strategy": "fsdp"}
Z3 = {"strategy": "deepspeed", "deepspeed": {"zero_stage": 3}}
#: run name -> (distributed section, dpo overrides, model overrides)
RUNS: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {
    "fsdp_replicated": ({**FSDP, "shard_frozen": False}, {}, {}),
    "fsdp_sharded": ({**FSDP, "shard_frozen": True}, {}, {}),
    "fsdp_auto": ({**FSDP, "shard_frozen": "auto"}, {}, {}),  # rank 1 "has 1 byte": shard on both ranks
    "fsdp_sharded_precompute": ({**FSDP, "shard_frozen": True}, {"precompute_ref_logps": True}, {}),
    "z3_replicated": ({**Z3, "shard_frozen": False}, {}, {}),
    "z3_sharded": ({**Z3, "shard_frozen": True}, {}, {}),
    "z3_sharded_bf16": ({**Z3, "shard_frozen": True}, {}, {"dtype": "bf16"}),
}


@pytest.fixture(scope="module")
def runs(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    root = tmp_path_factory.mktemp("frozen")
    base = {
        "algorithm": "dpo",
        "model": {"name_or_path": str(micro_model)},
        "data": {"train": "builtin:pref_train.jsonl", "eval": "builtin:pref_eval.jsonl", "max_length": 64,
                 "max_train_examples": 24, "max_eval_examples": 5},
        "training": {"per_device_batch_size": 2, "eval_batch_size": 2, "learning_rate": 5e-4, "max_steps": 3,
                     "lr_scheduler": "constant", "seed": 0, "max_grad_norm": 1.0},
        "dpo": {"reference": "model", "precompute_ref_logps": False, "beta": 0.5},
        "logging": {"logging_steps": 1, "report_to": ["jsonl"]},
        "checkpoint": {"save_final": True},
    }
    paths = []
    for name, (dist, dpo, model) in RUNS.items():
        if dist["strategy"] == "deepspeed" and not HAS_DEEPSPEED:
            continue
        cfg = copy.deepcopy(base)
        cfg.update(output_dir=str(root / name), distributed=dist)
        cfg["dpo"].update(dpo)
        cfg["model"].update(model)
        paths.append(str(write_config(root / f"{name}.yaml", cfg)))
    report = root / "report.json"
    proc = run_script(WORKERS / "frozen_sharding.py", nproc=2, args=[str(report), *paths], timeout=500)
    assert_ok(proc)
    return root, json.loads(report.read_text()), proc.stderr


def rows(run: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same_training(root: Path, a: str, b: str) -> None:
    ra, rb = rows(root / a), rows(root / b)
    losses = [r["loss"] for r in ra if "loss" in r]
    assert len(losses) == 3 and losses == pytest.approx([r["loss"] for r in rb if "loss" in r], abs=1e-5)
    assert losses[-1] != losses[0]  # it trained (policy and reference part ways after step 1)
    eval_a, eval_b = ([r for r in rs if "eval/loss" in r][-1] for rs in (ra, rb))
    for key in ("eval/loss", "eval/rewards/margin", "eval/kl"):
        assert eval_a[key] == pytest.approx(eval_b[key], abs=1e-5), key
    wa, wb = (load_file(str(root / n / "final" / "model.safetensors")) for n in (a, b))
    assert wa.keys() == wb.keys()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-5


def assert_sharded(facts: list[list[dict[str, Any]]], wrapper: str) -> None:
    """Each rank holds about half of the reference's largest weight, and eval mode without grads."""
    for rank_facts in facts:
        (f,) = rank_facts  # one frozen model per run, prepared once
        local, full = f["biggest"]
        assert f["decided"] and f["type"] == wrapper, f
        assert local == full // 2 and f["local"] < 0.6 * f["full"], f
        assert not f["training"] and not f["requires_grad"], f


def assert_replicated(facts: list[list[dict[str, Any]]]) -> None:
    for (f,) in facts:
        assert not f["decided"] and f["local"] == f["full"] and f["type"] == "CausalLMLogps", f
        assert not f["training"] and not f["requires_grad"], f


def test_fsdp_sharded_reference_trains_like_a_replicated_one(runs: tuple[Path, dict, str]) -> None:
    root, report, _ = runs
    assert_replicated(report["fsdp_replicated"])
    assert_sharded(report["fsdp_sharded"], "FSDPCausalLMLogps")
    assert_same_training(root, "fsdp_replicated", "fsdp_sharded")


def test_fsdp_sharded_reference_precomputes_the_same_logps(runs: tuple[Path, dict, str]) -> None:
    root, report, _ = runs
    assert_sharded(report["fsdp_sharded_precompute"], "FSDPCausalLMLogps")  # loaded for the precompute pass
    assert_same_training(root, "fsdp_replicated", "fsdp_sharded_precompute")


def test_auto_decides_from_the_smallest_device_on_every_rank(runs: tuple[Path, dict, str]) -> None:
    root, report, stderr = runs
    assert_sharded(report["fsdp_auto"], "FSDPCausalLMLogps")  # rank 0 alone would have replicated
    assert_same_training(root, "fsdp_replicated", "fsdp_auto")
    assert "Frozen models sharded (reference: distributed.shard_frozen=true)" in stderr
    assert "Frozen models replicated (reference: distributed.shard_frozen=false)" in stderr
    assert "Frozen models sharded (reference: " in stderr and "> 0.9 x 0.0 GB; " in stderr


@needs_deepspeed
def test_zero3_sharded_reference_trains_like_a_replicated_one(runs: tuple[Path, dict, str]) -> None:
    root, report, _ = runs
    assert_replicated(report["z3_replicated"])
    assert_sharded(report["z3_sharded"], "DeepSpeedEngine")
    assert_same_training(root, "z3_replicated", "z3_sharded")
    assert_same_training(root, "fsdp_replicated", "z3_sharded")


@needs_deepspeed
def test_zero3_sharded_reference_computes_in_the_engine_dtype(runs: tuple[Path, dict, str]) -> None:
    root, report, _ = runs
    assert_sharded(report["z3_sharded_bf16"], "DeepSpeedEngine")
    assert all(f["dtype"] == "bfloat16" for (f,) in report["z3_sharded_bf16"])
    bf16 = [r["loss"] for r in rows(root / "z3_sharded_bf16") if "loss" in r]
    fp32 = [r["loss"] for r in rows(root / "z3_replicated") if "loss" in r]
    assert bf16 == pytest.approx(fp32, abs=2e-3)  # bf16 round-off only (measured 3e-4)
