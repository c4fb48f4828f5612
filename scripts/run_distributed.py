#!/usr/bin/env python
"""Compatibility shim for the launcher command users know; it runs ``alignkit launch``.

    python scripts/run_distributed.py --nproc_per_node 4 --config configs/sft.yaml
    python scripts/run_distributed.py --nproc_per_node 4 --nnodes 2 --node_rank 0 \\
        --master_addr 192.168.1.100 --master_port 29500 --config configs/sft.yaml [key=value ...]

``--algorithm NAME`` becomes the override ``algorithm=NAME``; ``--use_torchrun`` is accepted (torchrun is
the default launcher); ``--launcher deepspeed|accelerate`` and ``--dry-run`` pass through. Anything else
that looks like ``key=value`` is a config override.
"""

from __future__ import annotations

import argparse
import sys


def to_launch_argv(argv: list[str]) -> list[str]:
    p = argparse.ArgumentParser(prog="run_distributed.py", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="YAML run config")
    p.add_argument("--nproc_per_node", "--nproc-per-node", type=int, default=None)
    p.add_argument("--nnodes", type=int, default=None)
    p.add_argument("--node_rank", "--node-rank", type=int, default=None)
    p.add_argument("--master_addr", "--master-addr", default=None)
    p.add_argument("--master_port", "--master-port", type=int, default=None)
    p.add_argument("--algorithm", default=None, help="sets the config's algorithm (e.g. sft, dpo)")
    p.add_argument("--use_torchrun", "--use-torchrun", action="store_true", help="accepted; torchrun is the default")
    p.add_argument("--launcher", default=None, choices=["torchrun", "deepspeed", "accelerate"])
    p.add_argument("--dry-run", "--dry_run", action="store_true")
    args, rest = p.parse_known_args(argv)
    bad = [a for a in rest if a.startswith("-") or "=" not in a]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)} (config overrides look like key=value)")
    out = ["launch"]
    for flag, value in (("--nproc-per-node", args.nproc_per_node), ("--nnodes", args.nnodes),
                        ("--node-rank", args.node_rank), ("--master-addr", args.master_addr),
                        ("--master-port", args.master_port), ("--launcher", args.launcher)):
        if value is not None:
            out += [flag, str(value)]
    if args.dry_run:
        out.append("--dry-run")
    out.append(args.config)
    if args.algorithm:
        out.append(f"algorithm={args.algorithm}")
    return out + rest


def main(argv: list[str] | None = None) -> int:
    from alignkit.cli import main as alignkit_main

    return alignkit_main(to_launch_argv(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
