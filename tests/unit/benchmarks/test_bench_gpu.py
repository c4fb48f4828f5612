"""benchmarks/bench_gpu.py and its helpers (no TRL, no GPU): the trace arithmetic (GPU idle gaps, CPU self
times), the speed readings, the op counter's sync classification and step snapshots through the real wrapper,
and the whole alignkit-only CPU micro run end to end, so the GPU benchmark cannot rot unseen."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import REPO

BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

import gpu_report  # noqa: E402
from gpu_probe import make_counters  # noqa: E402
from opcount import per_step  # noqa: E402


def _kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7}


def test_gpu_gaps_union_over_streams_and_gaps() -> None:
    # a: 0-10, b: 5-20 (overlaps a on another stream), c: 25-30 (gap 5), d: 100-110 (gap 70)
    events = [_kernel("a", 0, 10), _kernel("b", 5, 15), _kernel("c", 25, 5), _kernel("d", 100, 10)]
    got = gpu_report.gpu_gaps(events)
    assert got["gpu_span_ms"] == pytest.approx(0.110)
    assert got["gpu_busy_ms"] == pytest.approx(0.035)  # 0-20, 25-30, 100-110
    assert got["gpu_idle_ms"] == pytest.approx(0.075)
    assert got["gaps_over_10us"] == 1 and got["idle_in_gaps_over_10us_ms"] == pytest.approx(0.070)
    assert got["largest_gaps"][0] == {"us": 70.0, "after": "c", "before": "d"}
    assert got["largest_gaps"][1]["after"] == "b"  # the gap follows the activity that ended last


def test_trace_summary_reads_a_chrome_trace(tmp_path: Path) -> None:
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 1000, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": 10, "dur": 100, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 20, "dur": 60, "tid": 1},  # nested in linear
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 200, "dur": 30, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 300, "dur": 5, "tid": 1},
        _kernel("gemm", 50, 40), _kernel("gemm", 200, 40), _kernel("Memcpy DtoH (Device -> Pageable)", 300, 2, "gpu_memcpy"),
    ]
    trace = tmp_path / "t.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    got = gpu_report.trace_summary(trace)
    assert got["step_ms"] == pytest.approx(1.0) and got["cpu_ops"] == 3 and got["kernels"] == 2
    assert got["top_cpu_ops"][0] == {"name": "aten::mm", "calls": 2, "self_ms": 0.09}
    assert got["top_cpu_ops"][1] == {"name": "aten::linear", "calls": 1, "self_ms": 0.04}  # 100 - the nested 60
    assert got["top_kernels"][0]["name"] == "gemm" and got["top_kernels"][0]["calls"] == 2
    assert got["sync_calls"] == {"cudaStreamSynchronize": 1} and got["dtoh_copies"] == 1
    assert got["gaps_over_10us"] == 2


def test_speed_readings(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "time": 100.0 + 2 * s, "tokens_per_s": tps, "peak_mem_mb": m, "loss": 9.0 - s / 10}
            for s, tps, m in ((5, 50.0, 10.0), (10, 100.0, 30.0), (15, 300.0, 20.0))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ak = gpu_report.alignkit_speed(run, warm=5)
    assert ak["tok_s"] == 200.0 and ak["peak_mib"] == 30.0 and ak["steps"] == [10, 15]
    assert ak["s_per_step"] == pytest.approx(2.0) and ak["loss_first"] == 8.5
    trl = tmp_path / "trl.json"
    trl.write_text(json.dumps({"step_end": [1.0, 2.0, 3.0, 5.0], "step_tokens": [9, 9, 100, 300], "peak_mem_mib": 7}))
    got = gpu_report.trl_speed(trl, warm=2)
    assert got["tok_s"] == pytest.approx(400 / 3.0) and got["s_per_step"] == pytest.approx(1.5)
    assert gpu_report.mfu("dpo", 10.0, 1e12, 80.0) == pytest.approx(1.0)
    pairs = gpu_report.pairs({"a": {"tok_s": 300.0, "peak_mib": 5.0}, "b": {"tok_s": 100.0, "peak_mib": 10.0}}, [("a", "b")])
    assert pairs == [{"alignkit": "a", "trl": "b", "speed": 3.0, "memory": 0.5}]


def test_sync_classification() -> None:
    dispatched, reads = make_counters()
    x = torch.tensor([0.0, 1.0, 2.0])
    with reads, dispatched:
        x.nonzero()
        x[x > 0]
        x.sum().item()
        x.tolist()
        torch.repeat_interleave(torch.tensor([1, 2]))
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)
        x.repeat_interleave(2)  # int repeats: the size is known on the host
        x[torch.tensor([0, 2])]  # an integer index: no sync
    assert dispatched.syncs["nonzero"] == 1 and dispatched.syncs["index[bool mask]"] == 1
    assert dispatched.syncs["_local_scalar_dense"] == 1 and dispatched.syncs["repeat_interleave"] == 1
    assert sum(dispatched.syncs.values()) == 4 and dispatched.ops["index"] == 2
    assert reads.reads["tolist"] == 1 and reads.reads["item"] == 1


def test_opcount_wrapper_snapshots_every_optimizer_step(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, torch\n"
        "m = torch.nn.Linear(4, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for i in range(int(sys.argv[1])):\n"
        "    loss = m(torch.ones(2, 4)).sum(); loss.backward(); opt.step(); opt.zero_grad()\n"
        "    if i == 1: float(loss)  # one .item()-type sync in step 2 only\n"
        "sys.exit(3)\n")
    out = tmp_path / "oc.json"
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_probe.py"), "--opcount", str(out), "--", str(script), "4"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr  # the target's exit status
    got = json.loads(out.read_text())
    ops = [s["ops"] for s in got["steps"]]
    d = [b - a for a, b in zip(ops, ops[1:])]
    assert len(ops) == 4 and d == [d[0], d[0] + 1, d[0]]  # the same ops every step, + the one read after step 2
    assert got["syncs"] == {"_local_scalar_dense": 1} and got["reads"]["__float__"] == 1
    assert got["steps"][1]["syncs"] == {} and got["steps"][2]["syncs"] == {"_local_scalar_dense": 1}
    a = {"total": 100, "syncs": {"nonzero": 3}, "reads": {}}
    b = {"total": 160, "syncs": {"nonzero": 9, "equal": 3}, "reads": {"tolist": 6}}
    assert per_step(a, b, 3) == {"ops": 20.0, "syncs": {"equal": 1.0, "nonzero": 2.0}, "reads": {"tolist": 2.0}}


def test_gpu_tests_never_run_first() -> None:
    """gpu_checks.sh's GPU_TESTS_FIRST: a prefix names a file, a test or one parameter set; the rest go last."""
    from pytest_gpu_order import rank

    first = ["t/a.py::test_x", "t/b.py"]
    assert rank("t/a.py::test_x[fsdp]", first) == rank("t/a.py::test_x", first) == 0
    assert rank("t/b.py::test_y", first) == 1 and rank("t/a.py::test_xy", first) == rank("t/c.py::t", first) == 2


def test_trl_rows_get_the_time_of_their_pair() -> None:
    """A TRL row gets its alignkit pair's wall time x TRL_FACTOR + TRL_SETUP_S, or is skipped, saying why."""
    import bench_gpu

    bench = SimpleNamespace(device="cuda", res={"rows": {"ak_sft": {"rc": 0, "wall_s": 40.0}, "ak_dpo": {"rc": 1}}},
                            left=lambda: 200.0)
    names = ["ak_sft", "trl_sft_pf", "ak_dpo", "trl_dpo", "trl_lora"]
    trl_time = bench_gpu.Bench.trl_time
    need = 40.0 * bench_gpu.TRL_FACTOR + bench_gpu.TRL_SETUP_S
    assert trl_time(bench, {"name": "trl_sft_pf", "algo": "sft"}, names) == (need, None)
    assert trl_time(bench, {"name": "trl_dpo", "algo": "dpo"}, names)[1] == "skipped: its pair's alignkit row " \
        "ak_dpo did not run"
    assert trl_time(bench, {"name": "trl_lora", "algo": "sft"}, names) == (bench_gpu.CAP_S["cuda"], None)  # no pair
    bench.left = lambda: need  # less than need + 5 s of margin
    cap, why = trl_time(bench, {"name": "trl_sft_pf", "algo": "sft"}, names)
    assert cap is None and why.startswith(f"skipped: needs ~{need:.0f} s (ak_sft took 40 s")


#: the rows the end-to-end run checks (ak_fill_compile, torch.compile on CPU, is left out: it is the costliest
#: row and checks nothing the others do not; trl_sft_pf is there to be skipped)
E2E_ROWS = "ak_sft,trl_sft_pf,ak_dpo,ak_grpo,ak_lora,ak_fill,ak_gc"


@pytest.mark.slow(seconds=150)
def test_bench_gpu_cpu_micro_alignkit_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_gpu.py"), "--dry-run", "--skip-trl", "--budget", "1500",
                           "--only", E2E_ROWS,
                           "--out", str(out), "--scratch", str(tmp_path / "scratch"), "--strict"],
                          capture_output=True, text=True, timeout=1600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # what a GPU machine returns: three small files, the work stays in the scratch folder
    assert sorted(p.name for p in out.iterdir()) == ["bench-logs.tgz", "results.json", "summary.md"]
    with tarfile.open(out / "bench-logs.tgz") as tar:
        assert {"logs/ak_sft.log", "runs/ak_sft/metrics.jsonl", "ak_sft.yaml"} <= set(tar.getnames())
    res = json.loads((out / "results.json").read_text())
    rows = res["rows"]
    assert res["setup"]["make_model"]["n_params"] == 621120 and res["setup"]["gemm"]["gemm_tflops"] > 0
    for name in ("ak_sft", "ak_dpo", "ak_lora", "ak_gc", "ak_fill"):
        assert rows[name]["rc"] == 0 and rows[name]["tok_s"] > 0 and 0 < rows[name]["mfu"], (name, rows[name])
        assert rows[name]["peak_mib"] > 0 and rows[name]["s_per_step"] > 0
    assert rows["ak_grpo"]["rc"] == 0 and rows["ak_grpo"]["samples_per_s"] > 0
    assert all(rows[n]["skipped"] == "--skip-trl" and rows[n]["device"] == "CPU" for n in rows if n.startswith("trl"))
    assert "packed rows SDPA per example on cpu" in rows["ak_sft"]["attention"] and rows["ak_sft"]["torch"]
    prof = rows["ak_sft"]["profile"]
    assert prof["step_ms"] > 0 and prof["cpu_ops"] > 100 and prof["top_cpu_ops"]
    summary = (out / "summary.md").read_text()
    for name in ("ak_sft", "ak_dpo", "ak_lora", "ak_gc", "ak_fill", "ak_grpo", "trl_sft_pf"):
        assert f"| {name} |" in summary
    assert "### ak_sft: one profiled step" in summary
