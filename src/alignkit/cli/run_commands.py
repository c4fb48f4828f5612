"""Commands that take a run config: train, validate, launch, estimate, eval, prepare."""

from __future__ import annotations

import argparse
from typing import Any


def with_config(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("config", help="YAML run config")
    sp.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. training.learning_rate=1e-4")
    sp.add_argument("--algorithm", default=None, metavar="NAME",
                    help="the same as the override algorithm=NAME (the seed guides' `main.py --algorithm sft`)")
    sp.add_argument("--stage", default=None, choices=["pretrain", "sft"],
                    help="the VLM stage of a vlm_sft config: the same as the override vlm.stage=STAGE")


def cmd_train(args: argparse.Namespace) -> int:
    import alignkit.algorithms  # noqa: F401  (registers the algorithms and their config sections)
    from alignkit.config import load_config
    from alignkit.train.runner import run_train

    run_train(load_config(args.config, args.overrides))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from alignkit.train.plan_cli import print_plan

    print_plan(args.config, args.overrides, world_size=args.world_size)
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    import alignkit.algorithms  # noqa: F401  (registers the algorithms and their config sections)
    from alignkit.config import load_config
    from alignkit.launch import build_launch, run_launch

    # one error line here, not one per rank after start-up; rank 0 says the alias notes once, later
    cfg = load_config(args.config, args.overrides, notes=False)
    if args.slurm or args.k8s:
        return _cluster_launch(args)
    plan = build_launch(args.config, args.overrides, nproc_per_node=args.nproc_per_node, nnodes=args.nnodes,
                        node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
                        launcher=args.launcher)
    from alignkit.train.plan_cli import batch_growth_note

    note = batch_growth_note(cfg, plan.processes)
    plan.notes += [note] if note else []
    return run_launch(plan, dry_run=args.dry_run)


def _cluster_launch(args: argparse.Namespace) -> int:
    """``--slurm`` (srun over the allocation, or the sbatch script with --dry-run outside one) or ``--k8s`` (a
    PyTorchJob manifest); the rendezvous comes from the scheduler, never from --node-rank / --master-addr."""
    import os

    from alignkit import launch_k8s, launch_slurm
    from alignkit.launch import LaunchError, run_launch

    flag, source = ("--slurm", "the Slurm allocation") if args.slurm else ("--k8s", "the training operator")
    if args.slurm and args.k8s:
        raise LaunchError("--slurm and --k8s are two ways to start the run: choose one")
    if args.node_rank is not None or args.master_addr:
        raise LaunchError(f"with {flag}, the node rank and node 0's address come from {source}: drop --node-rank "
                          "and --master-addr")
    if args.k8s:
        print(launch_k8s.render_pytorchjob(args.config, args.overrides, image=args.image, nnodes=args.nnodes,
                                           nproc_per_node=args.nproc_per_node, launcher=args.launcher,
                                           name=args.job_name, pvc=args.pvc), end="")
        return 0
    if launch_slurm.in_allocation(os.environ) or not args.dry_run:  # outside one: a one-line error
        plan = launch_slurm.build_slurm(args.config, args.overrides, nproc_per_node=args.nproc_per_node,
                                        nnodes=args.nnodes, master_port=args.master_port, launcher=args.launcher)
        return run_launch(plan, dry_run=args.dry_run)
    print(launch_slurm.dry_run_script(args.config, args.overrides, nproc_per_node=args.nproc_per_node,
                                      nnodes=args.nnodes, master_port=args.master_port, launcher=args.launcher,
                                      job_name=launch_k8s.job_name(args.config, args.job_name)), end="")
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    from alignkit.train.estimate_cli import estimate_command

    estimate_command(args.config, args.overrides, gpus=args.gpus, gpu_memory=args.gpu_memory, preset=args.preset,
                     frozen=args.frozen)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from alignkit.train.evaluate import eval_command

    eval_command(args.config, args.overrides, args.model, args.out)
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from alignkit.train.prepare_cli import prepare_command

    prepare_command(args.config, args.overrides)
    return 0


def _launch_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=None,
                    help="processes on this node (default: its GPU count, 1 without GPUs)")
    sp.add_argument("--nnodes", type=int, default=None,
                    help="number of nodes (default 1; with --slurm: the allocation's, which it must equal)")
    sp.add_argument("--node-rank", "--node_rank", type=int, default=None,
                    help="this node's index in [0, nnodes) (default 0)")
    sp.add_argument("--master-addr", "--master_addr", default=None,
                    help="address of node 0 (required with --nnodes > 1; default 127.0.0.1)")
    sp.add_argument("--master-port", "--master_port", type=int, default=None,
                    help="rendezvous port (default 29500; on one node a free port if 29500 is taken)")
    sp.add_argument("--launcher", default="torchrun", choices=["torchrun", "deepspeed", "accelerate"])
    sp.add_argument("--dry-run", "--dry_run", action="store_true", help="print the command instead of running it")
    sp.add_argument("--slurm", action="store_true",
                    help="in a Slurm job: srun starts the launcher on every node (nodes, GPUs, rendezvous from the "
                    "allocation); outside one, with --dry-run: print the sbatch script")
    sp.add_argument("--k8s", action="store_true",
                    help="print a Kubeflow PyTorchJob manifest for the run (pipe it to kubectl apply -f -); needs --image")
    sp.add_argument("--image", default=None, help="--k8s: the container image every pod runs (alignkit installed)")
    sp.add_argument("--pvc", default=None, metavar="CLAIM",
                    help="--k8s: a PersistentVolumeClaim mounted at /workspace, the pods' working folder (checkpoints "
                    "outlive the pods)")
    sp.add_argument("--job-name", "--job_name", default=None,
                    help="--slurm / --k8s: the job's name (default alignkit-<config file name>)")


def register(sub: Any) -> None:
    sp = sub.add_parser("train", help="train with a YAML config (under any launcher, or alone)")
    with_config(sp)
    sp.set_defaults(func=cmd_train)

    sp = sub.add_parser("validate", help="print the resolved config and the plan, then exit")
    with_config(sp)
    sp.add_argument("--world-size", type=int, default=None, help="plan for N processes (default: the launcher's)")
    sp.set_defaults(func=cmd_validate)

    sp = sub.add_parser("launch", help="run `alignkit train` under torchrun / deepspeed / accelerate (one or several nodes)")
    _launch_options(sp)
    with_config(sp)
    sp.set_defaults(func=cmd_launch)

    sp = sub.add_parser("estimate", help="per-GPU memory of a config under ddp / ZeRO 1-3 / FSDP, and which fit")
    with_config(sp)
    sp.add_argument("--gpus", type=int, default=None, help="number of GPUs (default: the launcher's world size, or 1)")
    sp.add_argument("--gpu-memory", "--gpu_memory", default=None,
                    help="memory per GPU, e.g. 80GB or 64GiB (default: the local GPU's, if any)")
    sp.add_argument("--preset", default=None,
                    help="policy dimensions from a preset (llama-7b, mistral-7b, qwen2-0.5b) instead of model.name_or_path")
    sp.add_argument("--frozen", action="append", default=[], metavar="MODEL",
                    help="add a frozen reward/cost model (preset or local dir); repeat for several")
    sp.set_defaults(func=cmd_estimate)

    sp = sub.add_parser("eval", help="evaluate a model on the config's data.eval (RM/CM: pairwise accuracy, margin)")
    with_config(sp)
    sp.add_argument("--model", default=None,
                    help="model or adapter dir to evaluate (default: OUTPUT_DIR/final if it exists, else model.name_or_path)")
    sp.add_argument("--out", default=None, help="also write the metrics as one JSON line to this file")
    sp.set_defaults(func=cmd_eval)

    sp = sub.add_parser("prepare", help="read and tokenise the config's data sets into the cache ahead of training")
    with_config(sp)
    sp.set_defaults(func=cmd_prepare)
