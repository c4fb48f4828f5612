"""``alignkit launch --slurm`` / ``--k8s`` without training: the sbatch script, the srun command read from an
allocation, the PyTorchJob manifest, and each bad input as one line (the runs: tests/distributed/test_launch_cluster.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from alignkit.launch.args import DEFAULT_PORT, LaunchError
from alignkit.launch.k8s import render_pytorchjob
from alignkit.launch.slurm import build_slurm, shipped_sbatch
from alignkit.launch.torchrun import shell_join
from tests.conftest import REPO, assert_ok, child_env, run_cli

CFG = "configs/sft.yaml"
FAKE_SLURM = REPO / "tests" / "fake_slurm"
JOB = {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NNODES": "2", "SLURMD_NODENAME": "gpu01",
       "SLURM_CPUS_ON_NODE": "64"}
HOSTS = {"gpu[01-02]": ["gpu01", "gpu02"]}


def slurm(env: dict[str, str], **kw: object):
    args = {"nproc_per_node": None, "nnodes": None, "master_port": None, "launcher": "torchrun", **kw}
    return build_slurm(CFG, ["a=1"], env=env, hostnames=HOSTS.__getitem__, py="py", **args)


def error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The one line a bad input ends with (exit status 2, no traceback)."""
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("alignkit: error: "), proc.stderr
    return lines[0]


def test_shipped_sbatch_is_the_template_at_its_defaults() -> None:
    text = (REPO / "scripts" / "slurm" / "train.sbatch").read_text()
    assert text == shipped_sbatch(), "regenerate: python -c 'from alignkit.launch.slurm import shipped_sbatch; " \
        "open(\"scripts/slurm/train.sbatch\", \"w\").write(shipped_sbatch())'"
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --signal=TERM@120", "#SBATCH --requeue"):
        assert line in text.splitlines()
    subprocess.run(["bash", "-n", str(REPO / "scripts" / "slurm" / "train.sbatch")], check=True)


def test_srun_command_from_the_allocation() -> None:
    plan = slurm({**JOB, "SLURM_GPUS_ON_NODE": "4"})
    assert plan.argv[:-1] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=64",
                              "--kill-on-bad-exit=1", "--export=ALL", "bash", "-c"]
    assert plan.argv[-1] == ('exec py -m torch.distributed.run --nproc_per_node=4 --nnodes=2 '
                             '--node_rank="$SLURM_NODEID" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" '
                             '-m alignkit train configs/sft.yaml a=1')
    assert plan.env["MASTER_ADDR"] == "gpu01"  # node 0: the first host, where the batch script runs
    assert int(plan.env["MASTER_PORT"]) > 0 and "a free port on this host" in plan.notes[0]
    assert "2 node(s) (gpu01 gpu02), 4 process(es) per node (SLURM_GPUS_ON_NODE)" in plan.notes[0]


@pytest.mark.parametrize(("extra", "nproc"), [({"SLURM_GPUS_PER_NODE": "h100:8"}, 8),
                                              ({"SLURM_GPUS_PER_NODE": "2"}, 2),
                                              ({"CUDA_VISIBLE_DEVICES": "0,1,2"}, 3)])
def test_gpus_per_node_from_the_allocation(extra: dict[str, str], nproc: int) -> None:
    assert f"--nproc_per_node={nproc} " in slurm({**JOB, **extra}).argv[-1]
    assert "--nproc_per_node=1 " in slurm({**JOB, **extra}, nproc_per_node=1).argv[-1]  # the option wins


def test_port_rules() -> None:
    assert slurm(JOB, master_port=31000).env["MASTER_PORT"] == "31000"
    assert slurm({**JOB, "MASTER_PORT": "31001"}).env["MASTER_PORT"] == "31001"
    # not on node 0 (an salloc shell on a login node): every node must agree without talking, so from the job id
    plan = slurm({**JOB, "SLURMD_NODENAME": "login1"})
    assert plan.env["MASTER_PORT"] == str(DEFAULT_PORT + 77) and "job id" in plan.notes[0]


def test_accelerate_per_node_and_deepspeed_refused_on_several_nodes() -> None:
    line = slurm({**JOB, "SLURM_GPUS_ON_NODE": "4"}, launcher="accelerate").argv[-1]
    assert '--num_processes=8 --num_machines=2 --machine_rank="$SLURM_NODEID" --main_process_ip="$MASTER_ADDR"' in line
    with pytest.raises(LaunchError, match="torchrun launcher for several nodes"):
        slurm(JOB, launcher="deepspeed")


def test_shell_join_expands_only_the_launcher_variables() -> None:
    line = shell_join(["printf", "%s\\n", "--node_rank=$RANK_X", "a b", "x=$HOME", "--y=$(id)"])
    out = subprocess.run(["bash", "-c", line], capture_output=True, text=True, env={"RANK_X": "3"}, check=True)
    assert out.stdout.splitlines() == ["--node_rank=3", "a b", "x=$HOME", "--y=$(id)"]


def test_slurm_dry_run_outside_an_allocation_prints_the_sbatch_script(tmp_path) -> None:
    proc = run_cli(["launch", "--slurm", "--dry-run", "--nnodes", "2", "--nproc-per-node", "4", CFG, "training.max_steps=5"],
                   cwd=REPO)
    assert_ok(proc)
    lines = proc.stdout.splitlines()
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=4", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --signal=TERM@120", "#SBATCH --requeue", "if [ $# -eq 0 ]; then set -- configs/sft.yaml training.max_steps=5; fi"):
        assert line in lines, line
    assert any(x.startswith("exec ") and "launch --slurm --nproc-per-node 4 " in x for x in lines)
    node = lines[-1].removeprefix("#   ")
    assert node == (f"{sys.executable} -m torch.distributed.run --nproc_per_node=4 --nnodes=2 "
                    '--node_rank="$SLURM_NODEID" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" '
                    "-m alignkit train configs/sft.yaml checkpoint.resume_from=latest training.max_steps=5")
    (tmp_path / "job.sbatch").write_text(proc.stdout)  # the whole output is the script (the rest are comments)
    subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")], check=True)


def slurm_env(**extra: str) -> dict[str, str]:
    env = child_env(PATH=f"{FAKE_SLURM}{os.pathsep}{os.environ['PATH']}", FAKE_SLURM_HOSTS="n1 n2", **extra)
    for k in [k for k in env if k.startswith("SLURM_")]:
        env.pop(k)
    return env


def test_slurm_bad_inputs_are_one_line() -> None:
    outside = error_line(run_cli(["launch", "--slurm", CFG], cwd=REPO, env=slurm_env()))
    assert "inside a Slurm allocation" in outside and "SLURM_JOB_ID" in outside and "--dry-run" in outside
    job = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2"}
    env = slurm_env(**job)
    env.update(job)
    line = error_line(run_cli(["launch", "--slurm", "--dry-run", "--nnodes", "4", CFG], cwd=REPO, env=env))
    assert "--nnodes 4 disagrees with the Slurm allocation: 2 node(s) (n1 n2)" in line
    line = error_line(run_cli(["launch", "--slurm", "--dry-run", CFG], cwd=REPO, env={**env, "SLURM_NNODES": "3"}))
    assert "SLURM_NNODES=3 but SLURM_JOB_NODELIST=n[1-2] names 2 host(s)" in line
    line = error_line(run_cli(["launch", "--slurm", "--dry-run", "--node-rank", "1", CFG], cwd=REPO, env=env))
    assert "come from the Slurm allocation: drop --node-rank" in line
    assert "choose one" in error_line(run_cli(["launch", "--slurm", "--k8s", CFG], cwd=REPO, env=env))
    # the same allocation read right: --dry-run prints the srun line it would run
    ok = run_cli(["launch", "--slurm", "--dry-run", CFG], cwd=REPO, env={**env, "MASTER_PORT": "31002"})
    assert_ok(ok)
    assert ok.stdout.startswith("MASTER_ADDR=n1 MASTER_PORT=31002 ") and " srun --nodes=2 --ntasks=2 " in ok.stdout


def test_k8s_manifest(tmp_path) -> None:
    text = render_pytorchjob(CFG, ["training.max_steps=5"], image="reg/alignkit:1", nnodes=3, nproc_per_node=4,
                             pvc="runs-claim")
    config_map, job = yaml.safe_load_all(text)
    assert config_map["kind"] == "ConfigMap" and config_map["metadata"]["name"] == "alignkit-sft-config"
    assert config_map["data"]["config.yaml"] == (REPO / CFG).read_text()
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == ("kubeflow.org/v1", "PyTorchJob", "alignkit-sft")
    assert job["spec"]["nprocPerNode"] == "4"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert (specs["Master"]["replicas"], specs["Worker"]["replicas"]) == (1, 2)
    for spec in specs.values():
        pod = spec["template"]["spec"]
        c = pod["containers"][0]
        assert (c["name"], c["image"], c["resources"]["limits"]["nvidia.com/gpu"]) == ("pytorch", "reg/alignkit:1", 4)
        assert c["command"][:2] == ["sh", "-c"] and c["command"][2] == (
            'exec python -m torch.distributed.run --nproc_per_node=4 --nnodes=3 --node_rank="$RANK" '
            '--master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" -m alignkit train /etc/alignkit/config.yaml '
            "checkpoint.resume_from=latest training.max_steps=5")
        assert c["workingDir"] == "/workspace" and {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert {"name": "workspace", "persistentVolumeClaim": {"claimName": "runs-claim"}} in pod["volumes"]
        assert c["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456}]
    one = list(yaml.safe_load_all(render_pytorchjob(CFG, [], image="i", nnodes=None, nproc_per_node=None)))[1]
    assert list(one["spec"]["pytorchReplicaSpecs"]) == ["Master"] and "workingDir" not in \
        one["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]


def test_k8s_bad_inputs_are_one_line() -> None:
    assert "--k8s needs --image" in error_line(run_cli(["launch", "--k8s", CFG], cwd=REPO))
    line = error_line(run_cli(["launch", "--k8s", "--image", "i", "--job-name", "My_Job", CFG], cwd=REPO))
    assert "--job-name 'My_Job': a Kubernetes name" in line
    line = error_line(run_cli(["launch", "--k8s", "--image", "i", "--master-addr", "h", CFG], cwd=REPO))
    assert "come from the training operator" in line
