"""safe_dpo under 2 processes (gloo): layout invariance of loss and gradient, lambda and J_C identical on
every rank, exact resume of the multiplier under both lambda updates (``workers/safe_dpo_sync.py``), and
the seed's launch script."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import assert_ok, run_script
from tests.safe_dpo_models import make_scorers

pytestmark = pytest.mark.distributed

WORKERS = Path(__file__).parent / "workers"


@pytest.fixture(scope="module")
def scorers(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_scorers(micro_model, tmp_path_factory.mktemp("scorers"))


STRATEGIES = {"ddp": ["distributed.strategy=ddp"], "fsdp": ["distributed.strategy=fsdp"],
              "zero3": ["distributed.strategy=deepspeed", "distributed.deepspeed.zero_stage=3"]}


@pytest.fixture(scope="module")
def launched(micro_model: Path, scorers: tuple[Path, Path],
             tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """ONE torchrun launch (a launch's start-up costs more than a run) of workers/safe_dpo_sync.py (its report in
    ``root/report.json``), then the three runs of STRATEGIES one after another (``root/<name>``)."""
    from tests.conftest import REPO
    from tests.unit.algorithms.test_safe_dpo_algorithm import overrides

    root = tmp_path_factory.mktemp("safe_dpo")
    runs = [a for name, strategy in STRATEGIES.items() for a in [
        str(REPO / "configs" / "safe_dpo.yaml"), *overrides(micro_model, scorers, root / name),
        "training.max_steps=4", "safe_dpo.cost_eval_every=1", "training.per_device_batch_size=2",
        "training.max_grad_norm=0", "logging.logging_steps=1", "checkpoint.save_steps=null",
        "checkpoint.save_each_epoch=false", "data.eval=[]", "logging.report_to=[jsonl]", *strategy]]
    proc = run_script(WORKERS / "safe_dpo_sync.py", nproc=2, timeout=900,
                      args=[str(micro_model), str(scorers[0]), str(scorers[1]), str(root / "report.json"), *runs])
    assert_ok(proc)
    return root, proc


def test_safe_dpo_sync_invariance_and_resume(launched: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    root, proc = launched
    out = json.loads((root / "report.json").read_text())
    assert out["failures"] == [], out["failures"]
    assert "ALL OK" in proc.stdout
    assert set(out["cases"]) == {"per_batch", "cached"}
    assert out["multiplier"]["world"] == 2 and len(out["multiplier"]["lambdas"]) == 5
    assert len(out["pid"]["lambdas"]) == 5 and out["pid"]["lambdas"] != out["multiplier"]["lambdas"]


def test_cost_estimate_under_fsdp_and_zero3_matches_ddp(launched: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    """The on-policy J_C estimate generates inside Strategy.full_params: under FSDP2 and DeepSpeed ZeRO-3 (the
    policy sharded over 2 processes) every estimate, lambda and the final weights equal DDP's (the three runs
    follow the sync checks in the file's one launch)."""
    from safetensors.torch import load_file

    from tests.distributed.runs import max_delta, metric

    root = launched[0]
    runs = {}
    for name in STRATEGIES:
        out = root / name
        runs[name] = {"J_C": metric(out, "J_C"), "lambda": metric(out, "lambda"),
                      "weights": load_file(str(out / "final" / "model.safetensors"))}
    assert len(runs["ddp"]["J_C"]) == 4
    for name in ("fsdp", "zero3"):
        for key in ("J_C", "lambda"):
            assert runs[name][key] == pytest.approx(runs["ddp"][key], abs=1e-4), (name, key)
        assert max_delta(runs["ddp"]["weights"], runs[name]["weights"]) < 2e-5, name
