"""``alignkit launch --k8s``: a Kubeflow PyTorchJob manifest (training operator, ``kubeflow.org/v1``) for the run.

The manifest is printed, not applied (``... | kubectl apply -f -``): a ConfigMap holding the config file, and a
PyTorchJob with one Master pod and ``nnodes - 1`` Worker pods, each running torchrun for its node. The operator gives
every pod ``MASTER_ADDR`` / ``MASTER_PORT`` (the master pod's headless service and the container port named
``pytorchjob-port``) and ``RANK`` = the pod's index (Master 0, Worker i -> i + 1) in every version; newer ones also
set ``PET_NNODES`` / ``PET_NODE_RANK`` / ``PET_NPROC_PER_NODE`` and a ``WORLD_SIZE`` of pods x processes. The pod's
command uses only the first three (``--node_rank="$RANK"``), so it reads the same under old and new operators;
torchrun then gives each rank RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT of its own.

What a pod also needs: ``/dev/shm`` larger than a container's 64 MB default (NCCL and data-loader workers use it), the
GPUs as a resource limit, and ``checkpoint.resume_from=latest`` so a pod the operator restarts (``OnFailure``)
continues from the newest checkpoint when ``output_dir`` is on a volume that outlives it (``--pvc``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from alignkit.launch.args import DEFAULT_PORT, LaunchError, check_launch_args
from alignkit.launch.torchrun import build_launch, launcher_argv, shell_join

CONFIG_DIR = "/etc/alignkit"
WORKSPACE = "/workspace"
#: the port name and default the training operator looks for on the container named "pytorch"
PORT_NAME, PORT = "pytorchjob-port", 23456
_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,40}[a-z0-9])?")


def job_name(config: str, name: str | None) -> str:
    """``--job-name``, else ``alignkit-<config stem>``: a DNS-1123 label short enough for the pod names the
    operator derives from it (``NAME-worker-12``)."""
    if name is None:
        stem = re.sub(r"[^a-z0-9-]+", "-", Path(config).stem.lower()).strip("-")
        name = f"alignkit-{stem}"[:42].rstrip("-")
    if not _NAME.fullmatch(name):
        raise LaunchError(f"--job-name {name!r}: a Kubernetes name is lowercase letters, digits and '-', starts and "
                          "ends with a letter or digit, at most 42 characters here")
    return name


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the config file) as literal blocks, readable in the manifest; the Master and Worker pods
    written out in full (no YAML anchors)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s
                                                             else None))


def pod_command(overrides: list[str], *, launcher: str, nproc: int, nnodes: int) -> list[str]:
    """The container's command: ``sh -c 'exec <launcher> ...'``, the rendezvous from the operator's variables."""
    train = ["alignkit", "train", f"{CONFIG_DIR}/config.yaml", "checkpoint.resume_from=latest", *overrides]
    argv = launcher_argv(launcher, "python", nproc=nproc, nnodes=nnodes, node_rank="$RANK",
                         master_addr="$MASTER_ADDR", master_port="$MASTER_PORT", train=train)
    return ["sh", "-c", "exec " + shell_join(argv)]


def _pod(name: str, image: str, command: list[str], nproc: int, pvc: str | None) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "pytorch",  # the operator sets its variables on the container of this name
        "image": image,
        "command": command,
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
        "ports": [{"name": PORT_NAME, "containerPort": PORT}],
        "resources": {"limits": {"nvidia.com/gpu": nproc}},
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    volumes: list[dict[str, Any]] = [{"name": "config", "configMap": {"name": f"{name}-config"}},
                                     {"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if pvc:
        container["workingDir"] = WORKSPACE  # a relative output_dir (runs/sft) lands on the volume
        container["volumeMounts"].append({"name": "workspace", "mountPath": WORKSPACE})
        volumes.append({"name": "workspace", "persistentVolumeClaim": {"claimName": pvc}})
    return {"spec": {"containers": [container], "volumes": volumes}}


def local_path_warning(key: str, value: str | None, pvc: str | None) -> str | None:
    """One line when the config's ``key`` names a file or folder on this machine: the manifest carries the config, not
    the files it names. A warning, not a refusal: the image or the claim may hold the same path, which cannot be
    checked from here (the pods' working folder is /workspace with --pvc)."""
    if not value or not Path(value).exists():
        return None
    where = (f"the claim {pvc} holds {WORKSPACE}/{value}" if pvc and not Path(value).is_absolute() else "the image holds it")
    return (f"warning: --k8s: {key}={value} is a path on this machine, and the pods will not have it unless {where}: "
            "name a hub id or a path in the image (or on the claim)")


def render_pytorchjob(config: str, overrides: list[str], *, image: str | None, nnodes: int | None,
                      nproc_per_node: int | None, launcher: str = "torchrun", name: str | None = None,
                      pvc: str | None = None) -> str:
    """The manifest (a ConfigMap with the config file, then the PyTorchJob) as YAML text with a header."""
    if not image:
        raise LaunchError("--k8s needs --image: the container image every pod runs, with alignkit installed "
                          "(e.g. --image ghcr.io/you/alignkit:0.1; docs/distributed.md#kubernetes builds one)")
    check_launch_args(nproc_per_node=nproc_per_node, nnodes=nnodes, launcher=launcher)
    nodes, nproc = 1 if nnodes is None else nnodes, 1 if nproc_per_node is None else nproc_per_node
    # the checks of one node's launch (launcher, counts, deepspeed on one node only)
    build_launch(config, overrides, nproc_per_node=nproc, nnodes=nodes, node_rank=0, master_addr="master",
                 master_port=DEFAULT_PORT, launcher=launcher, gpus=nproc)
    name = job_name(config, name)
    text = Path(config).read_text(encoding="utf-8")
    pod = _pod(name, image, pod_command(overrides, launcher=launcher, nproc=nproc, nnodes=nodes), nproc, pvc)
    replicas = {"Master": 1, **({"Worker": nodes - 1} if nodes > 1 else {})}
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name},
           "spec": {"nprocPerNode": str(nproc), "pytorchReplicaSpecs": {
               kind: {"replicas": n, "restartPolicy": "OnFailure", "template": pod} for kind, n in replicas.items()}}}
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-config"},
                  "data": {"config.yaml": text if text.endswith("\n") else text + "\n"}}
    where = (f"output_dir is relative to {WORKSPACE} on the claim {pvc}" if pvc else
             "no --pvc: checkpoints and the final model stay in the pods and go with them")
    header = (f"# alignkit on Kubernetes: {nodes} pod(s) x {nproc} GPU(s), {config} as ConfigMap {name}-config.\n"
              "# Needs the Kubeflow training operator (PyTorchJob). Apply: alignkit launch --k8s ... | kubectl apply -f -\n"
              f"# Each pod: torchrun --node_rank=$RANK with the operator's MASTER_ADDR / MASTER_PORT; {where}.\n")
    return header + yaml.dump_all([config_map, job], Dumper=_Dumper, sort_keys=False, width=120)
