"""``alignkit data synth``: synthetic data with programmatically checkable answers (``cli/parser.py`` holds its
arguments)."""

from __future__ import annotations

import argparse
from pathlib import Path

from alignkit.data.synth import generate
from alignkit.data.synth_vlm import generate_vlm
from alignkit.errors import ConfigError


def objects_range(text: str) -> tuple[int, int]:
    """``--objects``: ``N`` or ``LO-HI`` -> (lo, hi); the range itself is checked by the generator."""
    try:
        lo, _, hi = text.partition("-")
        return int(lo), int(hi or lo)
    except ValueError:
        raise ConfigError(f"--objects: expected N or LO-HI (e.g. 1 or 1-3), got {text!r}") from None


def cmd_data_synth(args: argparse.Namespace) -> int:
    where = f" ({args.split} split)" if args.split else ""
    if args.kind == "vlm":  # images too: written to images/ beside the rows
        out = generate_vlm(args.n, args.seed, Path(args.out), stage=args.stage, split=args.split,
                           objects=objects_range(args.objects))
        print(f"wrote {args.n} vlm {args.stage} rows{where} to {out} and their images to {out.parent / 'images'}")
        return 0
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    generate(args.kind, args.n, args.seed, Path(args.out), split=args.split, tasks=tasks)
    print(f"wrote {args.n} {args.kind} rows{where} to {args.out}")
    return 0
