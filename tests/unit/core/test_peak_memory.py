"""The logged ``peak_mem_mb`` on CPU is the run's own peak, not that of the process that started it (Linux keeps
``ru_maxrss`` across exec; ``VmHWM`` starts with the new program)."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss surviving exec is Linux's behaviour")
def test_a_child_logs_its_own_peak_not_its_parents() -> None:
    big = torch.ones(100 * 2**20)  # 400 MB touched: this process's peak is now above 400 MB
    del big
    parent = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    code = ("import resource; from alignkit.logging import peak_memory_mb; "
            "print(peak_memory_mb('cpu'), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "src")})
    own, inherited = map(float, out.stdout.split())
    assert parent > 400 and inherited >= parent  # what the old reading logged
    assert 0 < own < 100 < parent, (own, parent)
