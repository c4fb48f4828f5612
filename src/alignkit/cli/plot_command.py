"""``alignkit plot``: pictures of runs from their metrics.jsonl (see :mod:`alignkit.plot`)."""

from __future__ import annotations

import argparse
from typing import Any


def cmd_plot(args: argparse.Namespace) -> int:
    from alignkit.plot import plot_runs

    path, panels = plot_runs(args.run_dirs, out=args.out, metrics=args.metrics)
    print(f"wrote {len(panels)} panels ({', '.join(panels)}) to {path}")
    return 0


def register(sub: Any) -> None:
    sp = sub.add_parser("plot", help="draw runs' metrics.jsonl against step (loss, lr, grad norm, tokens/s, eval, "
                                     "the algorithm's metrics) into one PNG; several runs are overlaid")
    sp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run's output_dir (holding metrics.jsonl)")
    sp.add_argument("--out", default=None, help="image to write, .png (or .pdf/.svg); default RUN_DIR/plots/summary.png "
                                                "for one run; for several, plots.png in the folder holding them "
                                                "(runs/plots.png for runs/a runs/b)")
    sp.add_argument("--metrics", nargs="+", default=None, metavar="NAME",
                    help="panels by name or glob, in this order, e.g. loss 'rewards/*' 'eval/*' (default: every "
                         "numeric metric)")
    sp.set_defaults(func=cmd_plot)
