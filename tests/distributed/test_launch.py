"""``alignkit launch`` end to end (2 gloo processes on CPU): the wrapper script, two "nodes" on one
machine matching one node with two processes, and the pre-flight check naming the bad rank."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import REPO, assert_ok, child_env, free_port, run_cli, run_nodes, run_script, write_config

pytestmark = pytest.mark.distributed

WORKERS = Path(__file__).parent / "workers"


@pytest.fixture(scope="module")
def launch_config(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SFT on the micro model: 40 examples, 2 ranks x 2 per device, 3 optimizer steps, no eval."""
    tmp = tmp_path_factory.mktemp("launch")
    return write_config(tmp / "sft.yaml", {
        "algorithm": "sft", "output_dir": str(tmp / "unused"), "model": {"name_or_path": str(micro_model)},
        "data": {"train": "builtin:sft_train.jsonl", "max_length": 64, "max_train_examples": 40},
        "training": {"per_device_batch_size": 2, "learning_rate": 1e-3, "max_steps": 3,
                     "lr_scheduler": "constant", "seed": 0},
        "logging": {"logging_steps": 1, "report_to": ["jsonl"]},
    })


@pytest.fixture(scope="module")
def script_run(launch_config: Path) -> tuple[Path, subprocess.CompletedProcess[str], str]:
    """``bash scripts/train_multi_gpu.sh CONFIG 2 output_dir=...`` (one node, two processes)."""
    out = launch_config.parent / "one_node"
    port = str(free_port())
    proc = subprocess.run(["bash", str(REPO / "scripts" / "train_multi_gpu.sh"), str(launch_config), "2",
                           f"output_dir={out}"], capture_output=True, text=True, timeout=300,
                          env=child_env(PYTHON=sys.executable, MASTER_PORT=port))
    return out, proc, port


def test_train_multi_gpu_script_end_to_end(launch_config: Path, script_run) -> None:
    out, proc, port = script_run
    assert_ok(proc)
    assert "Pre-flight OK: 2 ranks reachable" in proc.stderr
    assert "Strategy: ddp (auto: 2 processes" in proc.stderr
    assert (out / "final" / "model.safetensors").is_file()
    steps = [line for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(steps) == 3
    # the command it ran is exactly the one --dry-run prints for the same arguments
    ran = next(line for line in proc.stderr.splitlines() if line.startswith("alignkit launch: "))
    dry = run_cli(["launch", "--dry-run", "--nproc-per-node", "2", "--master-port", port, str(launch_config),
                   f"output_dir={out}"])
    assert_ok(dry)
    assert ran.removeprefix("alignkit launch: ") == dry.stdout.strip()


def test_two_nodes_on_one_machine_match_one_node(launch_config: Path, script_run) -> None:
    one_node, proc, _ = script_run
    assert_ok(proc)
    out = launch_config.parent / "two_nodes"
    port = str(free_port())
    cmd = lambda rank: [sys.executable, "-m", "alignkit", "launch", "--nnodes", "2", "--nproc-per-node", "1",  # noqa: E731
                        "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", port,
                        str(launch_config), f"output_dir={out}"]
    results = run_nodes([cmd(r) for r in (0, 1)])
    assert "Pre-flight OK: 2 ranks reachable" in results[0][1]
    a = load_file(one_node / "final" / "model.safetensors")
    b = load_file(out / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= 1e-6, worst


def test_preflight_names_the_mismatching_and_the_stuck_rank() -> None:
    proc = run_script(WORKERS / "preflight_worker.py", nproc=2, timeout=120)
    assert_ok(proc)
    lines = {" ".join(line.split(" ", 2)[:2]): line.split(" ", 2)[2]
             for line in proc.stdout.splitlines() if line.startswith("rank") and line.count(" ") >= 2}
    assert {"rank0 MISMATCH", "rank1 MISMATCH", "rank0 STUCK"} <= lines.keys(), proc.stdout + proc.stderr[-3000:]
    for rank in ("rank0", "rank1"):  # both ranks raise the same one-line error
        msg = lines[f"{rank} MISMATCH"]
        assert msg.startswith("pre-flight: ranks differ: rank 1 (") and "transformers 0.0.0-fake" in msg, msg
    stuck = lines["rank0 STUCK"]
    assert "not every rank arrived within 1.5 s" in stuck and "Ranks 1 failed to pass monitoredBarrier" in stuck
