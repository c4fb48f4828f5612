"""safe_dpo under 2 processes (gloo): layout invariance of loss and gradient, lambda and J_C identical on
every rank, exact resume of the multiplier (``workers/safe_dpo_sync.py``), and the seed's launch script."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import assert_ok, run_script
from tests.safe_dpo_models import make_scorers

pytestmark = pytest.mark.distributed

WORKERS = Path(__file__).parent / "workers"


@pytest.fixture(scope="module")
def scorers(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_scorers(micro_model, tmp_path_factory.mktemp("scorers"))


def test_safe_dpo_sync_invariance_and_resume(micro_model: Path, scorers: tuple[Path, Path], tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    proc = run_script(WORKERS / "safe_dpo_sync.py", nproc=2, timeout=600,
                      args=[str(micro_model), str(scorers[0]), str(scorers[1]), str(report)])
    assert_ok(proc)
    out = json.loads(report.read_text())
    assert out["failures"] == [], out["failures"]
    assert "ALL OK" in proc.stdout
    assert set(out["cases"]) == {"per_batch", "cached"}
    assert out["multiplier"]["world"] == 2 and len(out["multiplier"]["lambdas"]) == 5
