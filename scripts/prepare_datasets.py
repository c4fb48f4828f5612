#!/usr/bin/env python
"""The data preparation step users know; it runs ``alignkit prepare``.

    python scripts/prepare_datasets.py --config configs/dpo.yaml [--num_proc 8] [key=value ...]

Reads and tokenises data.train and data.eval into the cache (data.cache_dir) once, so that training
runs, and every rank of them, start by memory-mapping the result. ``--num_proc N`` is the override
``data.num_proc=N``; ``--algorithm NAME`` is ``algorithm=NAME``; other ``key=value`` are overrides.
"""

from __future__ import annotations

import argparse
import sys


def to_prepare_argv(argv: list[str]) -> list[str]:
    p = argparse.ArgumentParser(prog="prepare_datasets.py", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="YAML run config")
    p.add_argument("--num_proc", "--num-proc", type=int, default=None, help="tokenising processes (data.num_proc)")
    p.add_argument("--algorithm", default=None, help="sets the config's algorithm (e.g. sft, dpo)")
    args, rest = p.parse_known_args(argv)
    bad = [a for a in rest if a.startswith("-") or "=" not in a]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)} (config overrides look like key=value)")
    out = ["prepare", args.config]
    if args.num_proc is not None:
        out.append(f"data.num_proc={args.num_proc}")
    if args.algorithm:
        out.append(f"algorithm={args.algorithm}")
    return out + rest


def main(argv: list[str] | None = None) -> int:
    from alignkit.cli import main as alignkit_main

    return alignkit_main(to_prepare_argv(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
