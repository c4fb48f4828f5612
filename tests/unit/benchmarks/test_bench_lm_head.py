"""benchmarks/bench_lm_head.py end to end on a CPU shape: every variant runs and they agree on the loss."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import REPO


def test_lm_head_bench_runs_and_variants_agree() -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench_lm_head
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    rows = bench_lm_head.main(["--device", "cpu", "--tokens", "300", "--vocab", "500", "--hidden", "16",
                               "--dtype", "fp32", "--warmup", "0", "--iters", "1"])
    assert [r["variant"] for r in rows][1:] == ["chunked, 1024 rows (before)", "full logits (F.linear + cross_entropy)"]
    assert rows[0]["variant"] == "chunked, by memory (16777 rows)"  # 32 MiB / (4 x 500)
    assert all(r["ms"] > 0 for r in rows)
    assert [r["loss"] for r in rows] == pytest.approx([rows[2]["loss"]] * 3, rel=1e-5)
