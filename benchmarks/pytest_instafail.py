"""A pytest plugin (``-p pytest_instafail`` with ``benchmarks/`` on the path) that prints each failure's report
the moment the test fails, not in the summary at the end: a run stopped by its time limit (``gpu_checks.sh`` on a
leased GPU machine) still shows why every test that ran had failed."""

from __future__ import annotations

from typing import Any


def pytest_runtest_logreport(report: Any) -> None:
    if report.failed:
        print(f"\n=== FAILED {report.nodeid} ({report.when}) ===\n{report.longreprtext}\n=== end of {report.nodeid} ===",
              flush=True)
