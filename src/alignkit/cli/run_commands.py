"""Commands that train or launch a run config: train, launch (``cli/parser.py`` holds their arguments; eval,
validate, estimate and prepare have modules of their own)."""

from __future__ import annotations

import argparse
import os
import sys

import alignkit.algorithms  # noqa: F401  (registers the algorithms and their config sections)
from alignkit.cli.validate_command import batch_growth_note
from alignkit.config import RunConfig, load_config
from alignkit.launch import k8s, slurm
from alignkit.launch.args import LaunchError, check_launch_args
from alignkit.launch.run import run_launch
from alignkit.launch.torchrun import build_launch
from alignkit.train.generator_loop import check_separate_config
from alignkit.train.runner import run_train


def cmd_train(args: argparse.Namespace) -> int:
    run_train(load_config(args.config, args.overrides))
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    # the same one line for a bad count on every path (one node, --slurm, --k8s), before any default replaces it
    check_launch_args(nproc_per_node=args.nproc_per_node, nnodes=args.nnodes, launcher=args.launcher)
    if args.partition and not args.slurm:
        raise LaunchError("--partition goes with --slurm (it is written into the sbatch script as #SBATCH --partition)")
    # one error line here, not one per rank after start-up; rank 0 says the alias notes once, later
    cfg = load_config(args.config, args.overrides, notes=False)
    if args.slurm or args.k8s:
        return _cluster_launch(args, cfg)
    plan = build_launch(args.config, args.overrides, nproc_per_node=args.nproc_per_node, nnodes=args.nnodes,
                        node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
                        launcher=args.launcher)
    check_separate_config(cfg, plan.processes)  # before torchrun starts, dry run included
    note = batch_growth_note(cfg, plan.processes)
    plan.notes += [note] if note else []
    return run_launch(plan, dry_run=args.dry_run)


def _cluster_launch(args: argparse.Namespace, cfg: RunConfig) -> int:
    """``--slurm`` (srun over the allocation, or the sbatch script with --dry-run outside one) or ``--k8s`` (a
    PyTorchJob manifest); the rendezvous comes from the scheduler, never from --node-rank / --master-addr."""
    flag, source = ("--slurm", "the Slurm allocation") if args.slurm else ("--k8s", "the training operator")
    if args.slurm and args.k8s:
        raise LaunchError("--slurm and --k8s are two ways to start the run: choose one")
    if args.node_rank is not None or args.master_addr:
        raise LaunchError(f"with {flag}, the node rank and node 0's address come from {source}: drop --node-rank "
                          "and --master-addr")
    if args.k8s:
        manifest = k8s.render_pytorchjob(args.config, args.overrides, image=args.image, nnodes=args.nnodes,
                                         nproc_per_node=args.nproc_per_node, launcher=args.launcher,
                                         name=args.job_name, pvc=args.pvc)
        if warning := k8s.local_path_warning("model.name_or_path", cfg.model.name_or_path, args.pvc):
            print(f"alignkit launch: {warning}", file=sys.stderr)
        print(manifest, end="")
        return 0
    if slurm.in_allocation(os.environ) or not args.dry_run:  # outside one: a one-line error
        if args.partition:
            raise LaunchError("--partition names the partition in the sbatch script (--slurm --dry-run outside a "
                              "job); inside a Slurm job the allocation's partition is already fixed")
        plan = slurm.build_slurm(args.config, args.overrides, nproc_per_node=args.nproc_per_node,
                                 nnodes=args.nnodes, master_port=args.master_port, launcher=args.launcher)
        return run_launch(plan, dry_run=args.dry_run)
    print(slurm.dry_run_script(args.config, args.overrides, nproc_per_node=args.nproc_per_node,
                               nnodes=args.nnodes, master_port=args.master_port, launcher=args.launcher,
                               job_name=k8s.job_name(args.config, args.job_name), output_dir=str(cfg.output_dir),
                               partition=args.partition), end="")
    print(f"alignkit launch: the job log goes to {cfg.output_dir}/slurm-<job name>-<job id>.out; Slurm does not "
          f"create folders: mkdir -p {cfg.output_dir} before sbatch", file=sys.stderr)
    return 0
