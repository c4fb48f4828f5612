"""``alignkit migrate CONFIG [--out FILE]``: write a config's HF / seed-guide keys in alignkit's own."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import alignkit.algorithms  # noqa: F401  (registers the algorithms and their config sections)
from alignkit.config.migrate import migrate_file


def cmd_migrate(args: argparse.Namespace) -> int:
    text, notes = migrate_file(args.config)
    for line in notes:
        print(line, file=sys.stderr)
    if not notes:
        print(f"config: {args.config} uses alignkit's own keys already", file=sys.stderr)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # e.g. runs/native.yaml from a fresh clone
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote the native config to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
