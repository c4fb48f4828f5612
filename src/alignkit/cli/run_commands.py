"""Commands that train or launch a run config: train, launch (``cli/parser.py`` holds their arguments; eval,
validate, estimate and prepare have modules of their own)."""

from __future__ import annotations

import argparse
import os

import alignkit.algorithms  # noqa: F401  (registers the algorithms and their config sections)
from alignkit import launch_k8s, launch_slurm
from alignkit.cli.validate_command import batch_growth_note
from alignkit.config import load_config
from alignkit.launch import LaunchError, build_launch, run_launch
from alignkit.train.runner import run_train


def cmd_train(args: argparse.Namespace) -> int:
    run_train(load_config(args.config, args.overrides))
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    # one error line here, not one per rank after start-up; rank 0 says the alias notes once, later
    cfg = load_config(args.config, args.overrides, notes=False)
    if args.slurm or args.k8s:
        return _cluster_launch(args)
    plan = build_launch(args.config, args.overrides, nproc_per_node=args.nproc_per_node, nnodes=args.nnodes,
                        node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
                        launcher=args.launcher)
    note = batch_growth_note(cfg, plan.processes)
    plan.notes += [note] if note else []
    return run_launch(plan, dry_run=args.dry_run)


def _cluster_launch(args: argparse.Namespace) -> int:
    """``--slurm`` (srun over the allocation, or the sbatch script with --dry-run outside one) or ``--k8s`` (a
    PyTorchJob manifest); the rendezvous comes from the scheduler, never from --node-rank / --master-addr."""
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
