"""``Strategy.full_params`` under FSDP2 and DeepSpeed ZeRO-3 (2 gloo processes): generation from the
sharded model equals generation from the plain model, for a trainable handle and a frozen model;
parameters are whole inside the context and sharded before and after (worker: workers/full_params.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import assert_ok, run_script

pytestmark = pytest.mark.distributed
pytest.importorskip("deepspeed")


@pytest.fixture(scope="module")
def report(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = tmp_path_factory.mktemp("full_params") / "report.json"
    assert_ok(run_script(Path(__file__).parent / "workers" / "full_params.py", nproc=2, timeout=400,
                         args=[str(micro_model), str(path)]))
    return json.loads(path.read_text())


@pytest.mark.parametrize("engine", ["fsdp", "deepspeed"])
@pytest.mark.parametrize("role", ["trainable", "frozen"])
def test_generation_inside_full_params_equals_unsharded(report: dict, engine: str, role: str) -> None:
    r = report[engine][role]
    assert r["same"], (r["got"], r["want"])
    assert r["sharded_before"] > 0 and r["sharded_after"] == r["sharded_before"]
    assert r["sharded_inside"] == 0
