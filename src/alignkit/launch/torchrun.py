"""``alignkit launch`` on one node (or each of several, started by hand): the command that starts ``alignkit train``
under torchrun, the deepspeed launcher or accelerate.

The command is built once, printed, and run exactly as printed by :mod:`alignkit.launch.run` (``--dry-run`` only
prints it).
Facts it relies on (docs/ENGINES_ON_CPU.md):

* torchrun (``python -m torch.distributed.run``) takes ``--nnodes/--node_rank/--master_addr/--master_port``
  for a static multi-node rendezvous: node 0 hosts the store on the given port.
* ``deepspeed --num_gpus N --master_port P --module alignkit ...`` runs one node; several nodes need
  a hostfile and ssh (or ``--no_ssh`` plus a hostfile), so multi-node here goes through torchrun (the
  DeepSpeed *engine* does not care which launcher started it). It runs as ``python -m
  alignkit.launch.deepspeed_runner``: DeepSpeed's runner with its ``launch`` child armed to die with it.
* ``accelerate launch --cpu`` starts ONE process (trap A); on CPU machines ``--multi_gpu`` with
  ``ACCELERATE_USE_CPU=true`` gives gloo processes (trap B otherwise).
* Without OMP_NUM_THREADS each CPU rank starts one thread per core: N ranks oversubscribe the cores.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import sys
from dataclasses import dataclass, field

from alignkit.launch.args import DEFAULT_PORT, LaunchError, check_launch_args


@dataclass
class LaunchPlan:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the inherited environment
    notes: list[str] = field(default_factory=list)
    processes: int = 1  # over every node: what the effective batch is multiplied by

    def shell(self) -> str:
        """The command as one POSIX shell line, environment additions first (copy-pasteable)."""
        prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in self.env.items())
        return prefix + shlex.join(self.argv)


def port_is_free(port: int) -> bool:
    """True when nothing listens on ``port`` (the rendezvous store binds all interfaces)."""
    for family, addr in ((socket.AF_INET, ("", port)), (socket.AF_INET6, ("::", port))):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind(addr)
        except OSError as e:
            if family == socket.AF_INET6 and e.errno in (97, 99):  # no IPv6 on this host
                continue
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def build_launch(config: str, overrides: list[str], *, nproc_per_node: int | None = None, nnodes: int | None = 1,
                 node_rank: int | None = 0, master_addr: str | None = None, master_port: int | None = None,
                 launcher: str = "torchrun", gpus: int | None = None) -> LaunchPlan:
    """The launcher command for ``alignkit train CONFIG OVERRIDES`` (``gpus``: for tests; None = probe)."""
    check_launch_args(nproc_per_node=nproc_per_node, nnodes=nnodes, launcher=launcher)
    gpus = _cuda_count() if gpus is None else gpus
    nnodes, node_rank = 1 if nnodes is None else nnodes, 0 if node_rank is None else node_rank  # None: not given
    nproc = nproc_per_node if nproc_per_node is not None else max(1, gpus)
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node-rank {node_rank} is outside [0, --nnodes {nnodes})")
    plan = LaunchPlan(argv=[], processes=nproc * nnodes)
    if nnodes > 1:
        if not master_addr:
            raise LaunchError("--nnodes > 1 needs --master-addr (the address of node 0, the same on every node)")
        if launcher == "deepspeed":
            raise LaunchError("--launcher deepspeed starts one node here (several need its hostfile + ssh); use "
                              "the default torchrun launcher for several nodes: distributed.strategy=deepspeed "
                              "still runs DeepSpeed ZeRO")
        port = master_port or DEFAULT_PORT  # every node must use the same port: never pick one
    else:
        master_addr = master_addr or "127.0.0.1"
        port = master_port or DEFAULT_PORT
        if master_port is None and not port_is_free(port):
            port = free_port()
            plan.notes.append(f"port {DEFAULT_PORT} is taken; using free port {port} (set --master-port to choose)")
    if gpus == 0:
        if "OMP_NUM_THREADS" not in os.environ:
            plan.env["OMP_NUM_THREADS"] = "1"
        if launcher == "accelerate":
            plan.env["ACCELERATE_USE_CPU"] = "true"
        plan.notes.append(cpu_note(nproc, os.cpu_count() or 1, plan.env.get("OMP_NUM_THREADS")
                                   or os.environ.get("OMP_NUM_THREADS", "")))
    train = ["alignkit", "train", config, *overrides]
    plan.argv = launcher_argv(launcher, sys.executable, nproc=nproc, nnodes=nnodes, node_rank=str(node_rank),
                              master_addr=master_addr, master_port=str(port), train=train)
    return plan


def cpu_note(nproc: int, cores: int, threads: str) -> str:
    """What a launch without a GPU is about to do: ``nproc`` CPU processes over gloo sharing ``cores`` cores."""
    share = (f"; {nproc} processes on {cores} cores take turns, so each step is slower than on one process"
             if nproc > cores else "")
    return (f"no GPU here: {nproc} CPU process(es) per node over gloo on {cores} CPU core(s), "
            f"OMP_NUM_THREADS={threads or 'unset'} each{share}")


def launcher_argv(launcher: str, py: str, *, nproc: int, nnodes: int, node_rank: str, master_addr: str,
                  master_port: str, train: list[str]) -> list[str]:
    """The launcher's argv for one node. ``node_rank`` / ``master_addr`` / ``master_port`` are strings so a
    cluster launch (``launch.slurm``, ``launch.k8s``) can pass shell variables (``$SLURM_NODEID``) that each
    node expands (:func:`shell_join`)."""
    if launcher == "torchrun":
        return [py, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--nnodes={nnodes}",
                f"--node_rank={node_rank}", f"--master_addr={master_addr}", f"--master_port={master_port}",
                "-m", *train]
    if launcher == "deepspeed":
        return [py, "-m", "alignkit.launch.deepspeed_runner", f"--num_gpus={nproc}", f"--master_port={master_port}",
                "--no_local_rank", "--module", *train]
    total = nproc * nnodes
    return [py, "-m", "accelerate.commands.launch", *(["--multi_gpu"] if total > 1 else []),
            f"--num_processes={total}", f"--num_machines={nnodes}", f"--machine_rank={node_rank}",
            f"--main_process_ip={master_addr}", f"--main_process_port={master_port}",
            "--mixed_precision=no", "--dynamo_backend=no", "-m", *train]


_OPTION_FROM_VAR = re.compile(r"(--[\w-]+)=\$([A-Za-z_]\w*)")


def shell_join(argv: list[str]) -> str:
    """``shlex.join`` except that a launcher option whose value is a shell variable (``--node_rank=$SLURM_NODEID``)
    stays expandable (``--node_rank="$SLURM_NODEID"``): the line a cluster runs on every node."""
    def one(arg: str) -> str:
        m = _OPTION_FROM_VAR.fullmatch(arg)
        return f'{m.group(1)}="${m.group(2)}"' if m else shlex.quote(arg)

    return " ".join(one(a) for a in argv)
