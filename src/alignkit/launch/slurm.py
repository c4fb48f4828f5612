"""``alignkit launch --slurm``: one task per node under ``srun``, each starting the launcher (torchrun by default).

Inside an allocation (a batch script, or an ``salloc`` shell) the command reads it from the environment Slurm sets:

* the hosts: ``scontrol show hostnames $SLURM_JOB_NODELIST`` (``node[01-04]`` is Slurm's compressed form; scontrol is
  the one reader that knows every form); node 0 of the rendezvous is the first host, as ``srun`` numbers them
  (``SLURM_NODEID`` 0 is the first node of the step, which spans the allocation);
* the node count: ``SLURM_NNODES`` (``SLURM_JOB_NUM_NODES``), checked against the hosts and against ``--nnodes``;
* the processes per node: ``--nproc-per-node``, else the GPUs the allocation gives a node (``SLURM_GPUS_ON_NODE``,
  ``SLURM_GPUS_PER_NODE``, then ``CUDA_VISIBLE_DEVICES``), else what the local probe says (1 without GPUs);
* the port: ``--master-port``, ``$MASTER_PORT``, else a free port when this host is node 0 (the batch script runs on
  the allocation's first node), else one derived from the job id (every node must agree without talking).

It then runs ``srun --ntasks-per-node=1 ... bash -c 'exec <launcher> ... --node_rank="$SLURM_NODEID"'`` with
``MASTER_ADDR`` / ``MASTER_PORT`` exported: the per-node line is the same on every node and each expands its rank.
Outside an allocation only ``--dry-run`` works: it prints the sbatch script (``launch/slurm_train.sbatch.j2``, the
source of ``scripts/slurm/train.sbatch``) with the per-node command as comments at its end. That script runs the
interpreter that printed it (``$PYTHON`` overrides it), writes its job log under the run's ``output_dir``, and
names ``--partition`` when given.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import resources

from alignkit.launch.args import DEFAULT_PORT, LaunchError, check_launch_args
from alignkit.launch.torchrun import LaunchPlan, _cuda_count, build_launch, free_port, launcher_argv, shell_join

#: the shipped template's defaults (scripts/slurm/train.sbatch is this rendering)
TEMPLATE_DEFAULTS = {"nodes": 2, "gpus": 8, "time": "24:00:00", "signal_s": 120, "python": "python",
                     "log": "%x-%j.out"}
SCRIPT = "scripts/slurm/train.sbatch"


@dataclass
class SlurmAllocation:
    """What ``alignkit launch --slurm`` reads from the job's environment."""

    job_id: str
    hosts: list[str]
    gpus_per_node: int | None  # None: the allocation does not say
    gpus_from: str  # which variable said it
    cpus_per_node: int | None
    this_host: str


def in_allocation(env: Mapping[str, str]) -> bool:
    return bool((env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")) and
                (env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")))


def scontrol_hostnames(nodelist: str) -> list[str]:
    """``scontrol show hostnames NODELIST``: one host per line."""
    if shutil.which("scontrol") is None:
        raise LaunchError("--slurm: `scontrol` is not on PATH, so SLURM_JOB_NODELIST cannot be expanded "
                          "(run inside the Slurm job, on a node where the Slurm commands are installed)")
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=60,
                         check=False)
    if out.returncode != 0:
        raise LaunchError(f"--slurm: `scontrol show hostnames {nodelist}` failed: {out.stderr.strip()[:200]}")
    return [h for h in out.stdout.split() if h]


def _gpus(env: Mapping[str, str]) -> tuple[int | None, str]:
    if (v := env.get("SLURM_GPUS_ON_NODE", "").strip()).isdigit():
        return int(v), "SLURM_GPUS_ON_NODE"
    # --gpus-per-node=8 or =h100:8 (a type before the count)
    if m := re.fullmatch(r"(?:[\w.-]+:)?(\d+)", env.get("SLURM_GPUS_PER_NODE", "").strip()):
        return int(m.group(1)), "SLURM_GPUS_PER_NODE"
    cvd = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if cvd and cvd not in ("NoDevFiles", "-1"):
        return len([d for d in cvd.split(",") if d.strip()]), "CUDA_VISIBLE_DEVICES"
    return None, ""


def read_allocation(env: Mapping[str, str], hostnames: Callable[[str], list[str]] = scontrol_hostnames
                    ) -> SlurmAllocation:
    """The allocation this process runs in; a one-line error outside one or where its variables disagree."""
    if not in_allocation(env):
        raise LaunchError("--slurm runs inside a Slurm allocation, and SLURM_JOB_ID / SLURM_JOB_NODELIST are not set "
                          f"here: submit `sbatch {SCRIPT} CONFIG`, or print that script with "
                          "`alignkit launch --slurm --dry-run CONFIG`")
    nodelist = env.get("SLURM_JOB_NODELIST") or env["SLURM_NODELIST"]
    hosts = hostnames(nodelist)
    count = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")
    if not hosts or (count and count.strip().isdigit() and int(count) != len(hosts)):
        raise LaunchError(f"--slurm: SLURM_NNODES={count} but SLURM_JOB_NODELIST={nodelist} names "
                          f"{len(hosts)} host(s) ({' '.join(hosts[:8])})")
    gpus, gpus_from = _gpus(env)
    cpus = env.get("SLURM_CPUS_ON_NODE", "").strip()
    this_host = env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    return SlurmAllocation(job_id=env.get("SLURM_JOB_ID") or env["SLURM_JOBID"], hosts=hosts, gpus_per_node=gpus,
                           gpus_from=gpus_from, cpus_per_node=int(cpus) if cpus.isdigit() else None,
                           this_host=this_host)


def _port(alloc: SlurmAllocation, master_port: int | None, env: Mapping[str, str]) -> tuple[int, str]:
    if master_port is not None:
        return master_port, "--master-port"
    if (v := env.get("MASTER_PORT", "").strip()).isdigit():
        return int(v), "MASTER_PORT"
    if alloc.this_host == alloc.hosts[0]:
        return free_port(), "a free port on this host (node 0)"
    job = int(alloc.job_id) if alloc.job_id.isdigit() else 0
    return DEFAULT_PORT + job % 1000, f"derived from the job id (this host, {alloc.this_host}, is not node 0)"


def node_argv(config: str, overrides: list[str], *, launcher: str, nproc: int, nnodes: int, py: str) -> list[str]:
    """The launcher command every node runs; its rank and the rendezvous come from the node's environment."""
    return launcher_argv(launcher, py, nproc=nproc, nnodes=nnodes, node_rank="$SLURM_NODEID",
                         master_addr="$MASTER_ADDR", master_port="$MASTER_PORT",
                         train=["alignkit", "train", config, *overrides])


def srun_argv(nnodes: int, node: list[str], cpus_per_node: int | None) -> list[str]:
    """srun: one task per node over the whole allocation; it gets the node's CPUs (one task would get one CPU);
    a node that fails stops the others (--kill-on-bad-exit); the environment (MASTER_ADDR ...) goes along."""
    cpus = [f"--cpus-per-task={cpus_per_node}"] if cpus_per_node else []
    return ["srun", f"--nodes={nnodes}", f"--ntasks={nnodes}", "--ntasks-per-node=1", *cpus,
            "--kill-on-bad-exit=1", "--export=ALL", "bash", "-c", "exec " + shell_join(node)]


def build_slurm(config: str, overrides: list[str], *, nproc_per_node: int | None, nnodes: int | None,
                master_port: int | None, launcher: str, env: Mapping[str, str] | None = None,
                hostnames: Callable[[str], list[str]] = scontrol_hostnames, py: str | None = None) -> LaunchPlan:
    """The ``srun`` command for this allocation (``env``, ``hostnames``: for tests)."""
    check_launch_args(nproc_per_node=nproc_per_node, nnodes=nnodes, launcher=launcher)
    env = os.environ if env is None else env
    alloc = read_allocation(env, hostnames)
    n = len(alloc.hosts)
    if nnodes is not None and nnodes != n:
        raise LaunchError(f"--nnodes {nnodes} disagrees with the Slurm allocation: {n} node(s) "
                          f"({' '.join(alloc.hosts[:8])}); drop --nnodes or submit with `sbatch --nodes={nnodes}`")
    gpus = alloc.gpus_per_node if alloc.gpus_per_node is not None else _cuda_count()
    nproc = nproc_per_node if nproc_per_node is not None else max(1, gpus)
    port, port_from = _port(alloc, master_port, env)
    # build_launch checks the launcher and the counts and sets the CPU-only environment, as for one node
    base = build_launch(config, overrides, nproc_per_node=nproc, nnodes=n, node_rank=0, master_addr=alloc.hosts[0],
                        master_port=port, launcher=launcher, gpus=gpus)
    node = node_argv(config, overrides, launcher=launcher, nproc=nproc, nnodes=n, py=py or sys.executable)
    plan = LaunchPlan(argv=srun_argv(n, node, alloc.cpus_per_node),
                      env={"MASTER_ADDR": alloc.hosts[0], "MASTER_PORT": str(port), **base.env},
                      processes=base.processes)
    source = "--nproc-per-node" if nproc_per_node else (alloc.gpus_from or f"{gpus} GPU(s) seen here")
    plan.notes.append(f"Slurm job {alloc.job_id}: {n} node(s) ({' '.join(alloc.hosts[:8])}), {nproc} process(es) "
                      f"per node ({source}), rendezvous {alloc.hosts[0]}:{port} ({port_from})")
    return plan


def shipped_sbatch() -> str:
    """``scripts/slurm/train.sbatch``: the template at its defaults (a test keeps the file equal to this)."""
    return render_sbatch("configs/sft.yaml", [], nodes=TEMPLATE_DEFAULTS["nodes"], gpus=TEMPLATE_DEFAULTS["gpus"],
                         launch_options=[], job_name="alignkit")


def render_sbatch(config: str, overrides: list[str], *, nodes: int, gpus: int, launch_options: list[str],
                  job_name: str, launcher: str = "torchrun", script: str = SCRIPT, partition: str | None = None,
                  **defaults: object) -> str:
    """The sbatch script: ``launch/slurm_train.sbatch.j2`` filled in; ``defaults`` overrides TEMPLATE_DEFAULTS' time,
    signal_s, python (the interpreter the job runs unless $PYTHON is set) and log (``#SBATCH --output``)."""
    import jinja2

    text = resources.files("alignkit.launch").joinpath("slurm_train.sbatch.j2").read_text(encoding="utf-8")
    template = jinja2.Template(text, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    values = {k: v for k, v in TEMPLATE_DEFAULTS.items() if k not in ("nodes", "gpus")} | defaults
    return template.render(nodes=nodes, gpus=gpus, job_name=job_name, script=script, partition=partition,
                           launcher=launcher, default_args=shlex.join([config, *overrides]),
                           launch_options="".join(shlex.quote(o) + " " for o in launch_options), **values)


def dry_run_script(config: str, overrides: list[str], *, nproc_per_node: int | None, nnodes: int | None,
                   master_port: int | None, launcher: str, job_name: str, py: str | None = None,
                   output_dir: str = "runs", partition: str | None = None) -> str:
    """What ``--slurm --dry-run`` prints outside an allocation: the sbatch script, then (as comments, so the whole
    text is still the script) the srun line the job will run and each node's command. The script runs ``py``
    (default: this interpreter) and logs to ``output_dir/slurm-JOBNAME-JOBID.out``."""
    check_launch_args(nproc_per_node=nproc_per_node, nnodes=nnodes, launcher=launcher)
    nodes = 1 if nnodes is None else nnodes
    gpus = TEMPLATE_DEFAULTS["gpus"] if nproc_per_node is None else nproc_per_node
    # the checks of one node's launch (launcher, counts, deepspeed on one node only)
    build_launch(config, overrides, nproc_per_node=gpus, nnodes=nodes, node_rank=0, master_addr="node0",
                 master_port=master_port or DEFAULT_PORT, launcher=launcher, gpus=gpus)
    options = [*(["--nproc-per-node", str(nproc_per_node)] if nproc_per_node is not None else []),
               *(["--launcher", launcher] if launcher != "torchrun" else []),
               *(["--master-port", str(master_port)] if master_port else [])]
    py = py or sys.executable
    script = render_sbatch(config, overrides, nodes=nodes, gpus=gpus, launch_options=options, job_name=job_name,
                           launcher=launcher, script="job.sbatch", partition=partition, python=py,
                           log=f"{output_dir.rstrip('/')}/slurm-%x-%j.out")
    train = [config, "checkpoint.resume_from=latest", *overrides]
    node = node_argv(train[0], train[1:], launcher=launcher, nproc=gpus, nnodes=nodes, py=py)
    srun = shlex.join(srun_argv(nodes, node, None))
    return (f"{script}# In the job, with MASTER_ADDR = the first host of SLURM_JOB_NODELIST and MASTER_PORT = a free "
            f"port there, `alignkit launch --slurm` runs\n#   {srun}\n# so every node runs\n#   {shell_join(node)}\n")
