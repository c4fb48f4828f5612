"""``alignkit launch`` command building (no processes started) and the run_distributed.py shim."""

from __future__ import annotations

import importlib.util
import re
import socket
import sys

import pytest

from alignkit.cli import build_parser
from alignkit.launch.args import DEFAULT_PORT, LaunchError
from alignkit.launch.torchrun import build_launch, port_is_free
from tests.conftest import REPO

CFG = "configs/sft.yaml"


def test_torchrun_single_node_cpu() -> None:
    plan = build_launch(CFG, ["training.max_steps=2"], nproc_per_node=2, master_port=29611, gpus=0)
    assert plan.argv == [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
                         "--node_rank=0", "--master_addr=127.0.0.1", "--master_port=29611",
                         "-m", "alignkit", "train", CFG, "training.max_steps=2"]


def test_omp_threads_only_when_unset_and_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert build_launch(CFG, [], nproc_per_node=2, master_port=1, gpus=0).env == {"OMP_NUM_THREADS": "1"}
    assert build_launch(CFG, [], nproc_per_node=2, master_port=1, gpus=2).env == {}
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert build_launch(CFG, [], nproc_per_node=2, master_port=1, gpus=0).env == {}


def test_default_port_taken_picks_a_free_one_on_one_node() -> None:
    holder = None
    if port_is_free(DEFAULT_PORT):
        holder = socket.socket()
        holder.bind(("", DEFAULT_PORT))
        holder.listen()
    try:
        plan = build_launch(CFG, [], nproc_per_node=2, gpus=0)
        port = int(next(a for a in plan.argv if a.startswith("--master_port=")).split("=")[1])
        assert port != DEFAULT_PORT and plan.notes and "taken" in plan.notes[0]
        # an explicit port is used as given, and several nodes never pick one
        assert "--master_port=29500" in build_launch(CFG, [], nproc_per_node=2, master_port=DEFAULT_PORT, gpus=0).argv
        multi = build_launch(CFG, [], nproc_per_node=1, nnodes=2, node_rank=1, master_addr="10.0.0.1", gpus=0)
        assert "--master_port=29500" in multi.argv and not any("taken" in n for n in multi.notes)
    finally:
        if holder is not None:
            holder.close()


def test_multi_node_arguments() -> None:
    plan = build_launch(CFG, [], nproc_per_node=4, nnodes=2, node_rank=1, master_addr="192.168.1.100",
                        master_port=29500, gpus=4)
    assert plan.argv[3:8] == ["--nproc_per_node=4", "--nnodes=2", "--node_rank=1", "--master_addr=192.168.1.100",
                              "--master_port=29500"]
    with pytest.raises(LaunchError, match="needs --master-addr"):
        build_launch(CFG, [], nproc_per_node=4, nnodes=2, node_rank=0, gpus=4)
    with pytest.raises(LaunchError, match="outside"):
        build_launch(CFG, [], nproc_per_node=4, nnodes=2, node_rank=2, master_addr="a", gpus=4)
    with pytest.raises(LaunchError, match="torchrun launcher for several nodes"):
        build_launch(CFG, [], nproc_per_node=4, nnodes=2, node_rank=0, master_addr="a", launcher="deepspeed", gpus=4)


def test_deepspeed_and_accelerate_commands() -> None:
    ds = build_launch(CFG, ["a=1"], nproc_per_node=2, master_port=29612, launcher="deepspeed", gpus=0)
    assert ds.argv[1:] == ["-m", "alignkit.launch.deepspeed_runner", "--num_gpus=2", "--master_port=29612",
                           "--no_local_rank", "--module", "alignkit", "train", CFG, "a=1"]
    acc = build_launch(CFG, [], nproc_per_node=2, nnodes=2, node_rank=0, master_addr="10.0.0.1", master_port=29613,
                       launcher="accelerate", gpus=0)
    assert acc.env["ACCELERATE_USE_CPU"] == "true"  # trap B: without it every rank trains alone
    assert "--cpu" not in acc.argv  # trap A: --cpu starts one process
    assert acc.argv[3:10] == ["--multi_gpu", "--num_processes=4", "--num_machines=2", "--machine_rank=0",
                              "--main_process_ip=10.0.0.1", "--main_process_port=29613", "--mixed_precision=no"]
    assert "ACCELERATE_USE_CPU" not in build_launch(CFG, [], nproc_per_node=2, launcher="accelerate",
                                                    master_port=1, gpus=2).env


def test_cli_accepts_seed_spellings() -> None:
    p = build_parser()
    a = p.parse_args(["launch", "--nproc_per_node", "4", "--nnodes", "2", "--node_rank", "1", "--master_addr", "h",
                      "--master_port", "29500", "--dry-run", CFG, "x=1"])
    b = p.parse_args(["launch", "--nproc-per-node", "4", "--nnodes", "2", "--node-rank", "1", "--master-addr", "h",
                      "--master-port", "29500", "--dry-run", CFG, "x=1"])
    assert vars(a) == vars(b)
    assert (a.nproc_per_node, a.nnodes, a.node_rank, a.master_addr, a.master_port) == (4, 2, 1, "h", 29500)


def test_run_distributed_shim_maps_onto_launch() -> None:
    spec = importlib.util.spec_from_file_location("run_distributed", REPO / "scripts" / "run_distributed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    argv = mod.to_launch_argv(["--nproc_per_node", "4", "--nnodes", "2", "--node_rank", "0", "--master_addr",
                               "192.168.1.100", "--master_port", "29500", "--config", "x.yaml", "--algorithm",
                               "sft", "--use_torchrun", "training.max_steps=3"])
    assert argv == ["launch", "--nproc-per-node", "4", "--nnodes", "2", "--node-rank", "0", "--master-addr",
                    "192.168.1.100", "--master-port", "29500", "x.yaml", "algorithm=sft", "training.max_steps=3"]
    with pytest.raises(SystemExit):
        mod.to_launch_argv(["--config", "x.yaml", "--mode", "train"])


@pytest.mark.parametrize("script", sorted((REPO / "scripts").glob("train_*.bat")), ids=lambda p: p.name)
def test_bat_scripts_do_not_use_their_own_path_after_shift(script) -> None:
    """cmd.exe's SHIFT also shifts %0, so %~dp0 / %~nx0 after a SHIFT name an argument, not the
    script (no cmd.exe here to run the .bat twins: this guards that trap statically). Each script
    also passes its arguments to ``alignkit launch`` like its .sh twin."""
    lines = script.read_text().splitlines()
    code = [line for line in lines if not line.lower().startswith("rem")]
    first_shift = next(i for i, line in enumerate(code) if line.strip().lower() == "shift")
    after = "\n".join(code[first_shift:])
    assert "%~dp0" not in after and "%~nx0" not in after and "%0" not in after
    assert any("-m alignkit launch" in line for line in code)
    sh = script.with_suffix(".sh")
    assert sh.is_file(), f"{script.name} has no .sh twin"


def test_launch_says_the_batch_grows_with_the_processes(micro_model, tmp_path) -> None:
    """Issue 42.5: a per-device batch under N processes is N times the one-process batch, and an epoch N times
    fewer optimizer steps; `launch` says so in one line (with the steps per epoch), and not for a global batch."""
    from tests.conftest import assert_ok, run_cli

    base = ["configs/sft.yaml", f"model.name_or_path={micro_model}", "data.max_train_examples=100",
            "training.per_device_batch_size=4", "training.gradient_accumulation_steps=2"]
    proc = run_cli(["launch", "--nproc-per-node", "4", "--nnodes", "2", "--node-rank", "0", "--master-addr", "h",
                    "--dry-run", *base], cwd=REPO)
    assert_ok(proc)
    # 100 examples / 8 ranks = 12 each = 3 micro-batches of 4 -> 2 steps; one rank: 25 micro-batches -> 13 steps
    assert ("alignkit launch: effective batch 64 = per_device 4 x accumulation 2 x 8 processes (8 on one process): "
            "2 optimizer steps per epoch (13 on one); set training.global_batch_size") in proc.stderr
    proc = run_cli(["launch", "--nproc-per-node", "2", "--dry-run", *base[:3], "training.global_batch_size=8",
                    "training.per_device_batch_size=null"],
                   cwd=REPO)
    assert_ok(proc)
    assert "effective batch" not in proc.stderr
    # online: an iteration draws global_batch / num_generations prompts (1000 prompts, 64 completions of 8 a rank)
    proc = run_cli(["launch", "--nproc-per-node", "2", "--dry-run", "configs/grpo.yaml",
                    f"model.name_or_path={micro_model}"], cwd=REPO)
    assert_ok(proc)
    assert "x 2 processes (64 on one process): 62 optimizer steps per epoch (125 on one)" in proc.stderr
    proc = run_cli(["validate", "configs/grpo.yaml", f"model.name_or_path={micro_model}"], cwd=REPO)
    assert_ok(proc)
    assert re.search(r"^optimizer steps per epoch +125$", proc.stdout, flags=re.MULTILINE), proc.stdout[-800:]
