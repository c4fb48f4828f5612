"""benchmarks/bench_sft_dpo.py: the GEMM peak for MFU is the higher of a start and an end probe, a spread
over 10% is a warning, and both are recorded (the probes themselves are not run here)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "benchmarks" / "bench_sft_dpo.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_sft_dpo", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def probe(gflops: float) -> dict[str, Any]:
    return {"ok": True, "gemm_gflops": gflops, "gemm_best_s": 0.1, "params": {}, "torch": "x", "threads": 2}


def settle(bench: ModuleType, start: float, end: dict[str, Any], given: float = 0.0) -> dict[str, Any]:
    calls: list[int] = []

    def measure_end() -> dict[str, Any]:
        calls.append(1)
        return end

    out = bench.settle_peak(probe(start), measure_end, given)
    assert calls == [1]
    return out


def test_a_busy_start_is_outvoted_and_flagged(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    got = settle(bench, 127.0, probe(195.6))
    assert got["gemm_gflops"] == got["gemm_measured_gflops"] == 195.6
    assert (got["gemm_start_gflops"], got["gemm_end_gflops"]) == (127.0, 195.6)
    assert got["gemm_spread"] == pytest.approx((195.6 - 127.0) / 195.6)
    assert got["gemm"]["gemm_gflops"] == 127.0 and got["gemm_end"]["gemm_gflops"] == 195.6
    printed = capsys.readouterr().out
    assert "WARNING: fp32 GEMM peak 127.0 GFLOP/s at the start, 195.6 at the end (35% apart)" in printed
    assert got["gemm_warning"] in printed
    # the other way round (busy at the end): the same choice
    assert settle(bench, 195.6, probe(127.0))["gemm_gflops"] == 195.6


def test_close_probes_take_the_higher_without_a_warning(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    got = settle(bench, 190.0, probe(195.0))
    assert got["gemm_gflops"] == 195.0 and got["gemm_warning"] is None
    assert "WARNING" not in capsys.readouterr().out
    assert settle(bench, 200.0, probe(180.0))["gemm_warning"] is None  # 10% apart exactly: not more than 10%
    assert settle(bench, 200.0, probe(179.0))["gemm_warning"] is not None


def test_a_failed_end_probe_keeps_the_start(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    got = settle(bench, 180.0, {"ok": False, "error": "exit 1: boom"})
    assert got["gemm_gflops"] == 180.0 and got["gemm_end_gflops"] is None and got["gemm_spread"] == 0.0
    assert "the end GEMM probe failed (exit 1: boom)" in capsys.readouterr().out


def test_a_given_peak_is_used_and_both_probes_recorded(bench: ModuleType) -> None:
    got = settle(bench, 127.0, probe(150.0), given=195.6)
    assert got["gemm_gflops"] == 195.6 and got["gemm_measured_gflops"] == 150.0
    assert (got["gemm_start_gflops"], got["gemm_end_gflops"]) == (127.0, 150.0) and got["gemm_warning"]


def test_the_table_names_both_probes_and_the_warning(bench: ModuleType) -> None:
    meta = {"when": "now", "cpu": "cpu", "torch": "2", "alignkit_commit": "abc", "quick": True, "loadavg_start": 0.1,
            **settle(bench, 127.0, probe(195.6))}
    table = bench.render([], meta)
    assert "fp32 GEMM peak 195.6 GFLOP/s (best of start 127.0, end 195.6)" in table
    assert f"**{meta['gemm_warning']}**" in table


def test_the_script_still_parses_its_arguments() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--peak-gflops" in proc.stdout and "--quick" in proc.stdout


def test_op_breakdown_splits_cpu_time_by_kind(bench: ModuleType) -> None:
    """--profile: GEMM and attention are self times, the optimizer its step's total, the rest is other."""
    from types import SimpleNamespace as E

    events = [E(key="aten::mm", self_cpu_time_total=6e6, cpu_time_total=6e6, count=10),
              E(key="aten::addmm", self_cpu_time_total=1e6, cpu_time_total=1e6, count=2),
              E(key="aten::_scaled_dot_product_flash_attention_for_cpu", self_cpu_time_total=1e6,
                cpu_time_total=1e6, count=4),
              E(key="Optimizer.step#AdamW.step", self_cpu_time_total=0.1e6, cpu_time_total=0.5e6, count=1),
              E(key="aten::_fused_adamw_", self_cpu_time_total=0.4e6, cpu_time_total=0.4e6, count=1),
              E(key="aten::mul", self_cpu_time_total=1.5e6, cpu_time_total=1.5e6, count=30)]
    out = bench.op_breakdown(events)
    assert out["total_s"] == pytest.approx(10.0)
    assert (out["gemm_s"], out["attention_s"], out["optimizer_s"]) == pytest.approx((7.0, 1.0, 0.5))
    assert out["other_s"] == pytest.approx(1.5)
    assert out["top"][0] == ["aten::mm", 6.0, 10]
