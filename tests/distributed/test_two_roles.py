"""Two trainable roles (actor + critic) through the real runner under single, DDP, FSDP2 and ZeRO-2:
both roles train, both are checkpointed in their own folder, and a resume from the middle continues
exactly (same losses and final weights of both roles as the straight run). The worker is
tests/distributed/workers/two_roles.py; one launch per engine runs the straight and the resumed run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import assert_ok, run_script

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).parent / "workers" / "two_roles.py"
ENGINES = {"single": 1, "ddp": 2, "fsdp": 2, "deepspeed": 2}


@pytest.fixture(scope="module")
def reports(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("two_roles")
    # one launch per process count: the 2-process engines run one after another in the same process group
    for nproc in sorted(set(ENGINES.values())):
        engines = [e for e, n in ENGINES.items() if n == nproc]
        assert_ok(run_script(WORKER, nproc=nproc, timeout=400, args=[str(micro_model), str(root), *engines]))
    return {engine: json.loads((root / engine / "report.json").read_text()) for engine in ENGINES}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_both_roles_checkpointed_and_resumed_exactly(reports: dict[str, dict], engine: str) -> None:
    r = reports[engine]
    assert r["checkpoint_roles"] == ["policy", "value"]
    assert len(r["straight"]) == 4 and len(r["resumed"]) == 2
    for a, b in zip(r["straight"][2:], r["resumed"]):
        assert abs(a - b) <= 1e-6, (engine, r["straight"], r["resumed"])
    for folder in ("final", "final_value"):
        w = r["weights"][folder]
        assert w["same_keys"] and w["keys"] > 0 and w["max_diff"] <= 1e-6, (engine, folder, w)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_both_roles_train_and_log(reports: dict[str, dict], engine: str) -> None:
    logged = reports[engine]["logged"]
    assert [row["step"] for row in logged] == [1, 2, 3, 4]
    for row in logged:
        assert all(math.isfinite(row[k]) for k in ("loss", "loss/value", "grad_norm", "grad_norm/value", "value_mse"))
        assert row["grad_norm/value"] > 0 and row["grad_norm"] > 0
    assert logged[-1]["loss"] < logged[0]["loss"]
    assert reports[engine]["value_moved"] > 1e-4  # the critic's own optimizer stepped it (steps 3-4)


def test_every_engine_computes_the_same_steps(reports: dict[str, dict]) -> None:
    """The same 4 examples per step: 1 process x 4 == 2 processes x 2, for both roles' updates."""
    ref = reports["single"]["logged"]
    for engine, r in reports.items():
        for a, b in zip(ref, r["logged"]):
            for k in ("loss", "loss/value", "value_mse"):
                assert abs(a[k] - b[k]) <= 1e-4 * max(1.0, abs(a[k])), (engine, k, a, b)
