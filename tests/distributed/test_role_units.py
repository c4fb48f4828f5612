"""``train/step.accumulate`` with a loss-unit count per role (flow_rtpo: attack sequences and (image, denoising
step) pairs in one step): each role normalised by its own global count and synced on its own last micro-batch,
alone and over 2 DDP ranks (gloo). The worker is tests/distributed/workers/role_units.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import assert_ok, run_script

WORKER = Path(__file__).parent / "workers" / "role_units.py"


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_each_role_gets_its_own_normaliser_and_sync(nproc: int) -> None:
    proc = run_script(WORKER, nproc=nproc, timeout=120)
    assert_ok(proc)
    assert proc.stdout.count("role units ok") == nproc
