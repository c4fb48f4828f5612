"""``alignkit launch`` end to end (2 gloo processes on CPU): the wrapper script, two "nodes" on one
machine matching one node with two processes, and the pre-flight check naming the bad rank.

``--slurm`` and ``--k8s`` the same way: two loopback "nodes" whose training equals one process. Slurm: the shipped
``scripts/slurm/train.sbatch`` run by bash (as sbatch would) with a fake ``srun`` and ``scontrol`` first on PATH
(``tests/fake_slurm``: srun starts its command once per node with SLURM_NODEID set). Kubernetes: the container
command of the rendered PyTorchJob, run twice with the variables the training operator gives the Master and the
Worker pod."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from tests.conftest import REPO, assert_ok, child_env, free_port, run_cli, run_nodes, run_script, write_config

pytestmark = pytest.mark.distributed

WORKERS = Path(__file__).parent / "workers"
FAKE_SLURM = REPO / "tests" / "fake_slurm"


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
    # its notes (the batch growing with the processes) come first, the command last
    ran = [line for line in proc.stderr.splitlines() if line.startswith("alignkit launch: ")][-1]
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


@pytest.fixture(scope="module")
def one_process(launch_config: Path) -> Path:
    """The same training in one process with the global batch (4) on it."""
    out = launch_config.parent / "one_process"
    assert_ok(run_cli(["train", str(launch_config), f"output_dir={out}", "training.per_device_batch_size=4"]))
    return out


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def assert_same_training(run: Path, reference: Path) -> None:
    a, b = _losses(run), _losses(reference)
    assert len(a) == 3 and a == pytest.approx(b, rel=1e-5, abs=1e-7), (a, b)
    wa, wb = load_file(run / "final" / "model.safetensors"), load_file(reference / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    worst = max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)
    assert worst <= 1e-5, worst


@pytest.mark.slow(seconds=45)
def test_slurm_sbatch_script_on_two_fake_nodes_equals_one_process(launch_config: Path, one_process: Path,
                                                                  tmp_path: Path) -> None:
    out, log = tmp_path / "slurm_run", tmp_path / "srun.log"
    env = child_env(PATH=f"{FAKE_SLURM}{os.pathsep}{os.environ['PATH']}", PYTHON=sys.executable,
                    SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node[1-2]", SLURM_NNODES="2",
                    SLURMD_NODENAME="127.0.0.1", FAKE_SLURM_HOSTS="127.0.0.1 127.0.0.1", SLURM_CPUS_ON_NODE="2",
                    FAKE_SRUN_LOG=str(log))
    proc = subprocess.run(["bash", str(REPO / "scripts" / "slurm" / "train.sbatch"), str(launch_config),
                           f"output_dir={out}"], capture_output=True, text=True, timeout=300, env=env, check=False)
    assert_ok(proc)
    assert "Pre-flight OK: 2 ranks reachable" in proc.stderr
    # the rendezvous read from the allocation: node 0 = the first host, a free port there, 1 process per node
    assert "Slurm job 4242: 2 node(s) (127.0.0.1 127.0.0.1), 1 process(es) per node" in proc.stderr
    assert log.read_text().split() == ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=2",
                                       "--kill-on-bad-exit=1", "--export=ALL"]
    assert_same_training(out, one_process)
    # the script's checkpoint.resume_from=latest: the first start began at step 0 in an empty output_dir
    assert "Resumed from" not in proc.stderr


@pytest.mark.slow(seconds=45)
def test_k8s_pytorchjob_pods_on_loopback_equal_one_process(launch_config: Path, one_process: Path,
                                                           tmp_path: Path) -> None:
    out = tmp_path / "k8s_run"
    rendered = run_cli(["launch", "--k8s", "--image", "alignkit:test", "--nnodes", "2", "--nproc-per-node", "1",
                        str(launch_config), f"output_dir={out}"])
    assert_ok(rendered)
    config_map, job = yaml.safe_load_all(rendered.stdout)
    config = tmp_path / "etc" / "config.yaml"  # the ConfigMap's file, where the pods mount it
    config.parent.mkdir()
    config.write_text(config_map["data"]["config.yaml"])
    specs, port = job["spec"]["pytorchReplicaSpecs"], str(free_port())
    commands, envs = [], []
    for rank, spec in enumerate([specs["Master"], specs["Worker"]]):
        container = spec["template"]["spec"]["containers"][0]
        commands.append([c.replace("/etc/alignkit/config.yaml", str(config)) for c in container["command"]])
        # what the operator sets on every pod (old and new versions), then the container's own env
        env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2", PET_NNODES="2",
                        PET_NODE_RANK=str(rank), PET_NPROC_PER_NODE="1", PYTHONUNBUFFERED="0",
                        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
        envs.append({**env, **{e["name"]: e["value"] for e in container["env"]}})
    results = run_nodes(commands, envs=envs)
    assert "Pre-flight OK: 2 ranks reachable" in results[0][1]
    assert_same_training(out, one_process)
