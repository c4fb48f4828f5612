"""``alignkit plot``: pictures of runs from their metrics.jsonl (see :mod:`alignkit.plot`)."""

from __future__ import annotations

import argparse

from alignkit.plot import plot_runs


def cmd_plot(args: argparse.Namespace) -> int:
    path, panels = plot_runs(args.run_dirs, out=args.out, metrics=args.metrics)
    print(f"wrote {len(panels)} panels ({', '.join(panels)}) to {path}")
    return 0
