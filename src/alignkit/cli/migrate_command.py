"""``alignkit migrate CONFIG [--out FILE]``: write a config's HF / seed-guide keys in alignkit's own."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def cmd_migrate(args: argparse.Namespace) -> int:
    import alignkit.algorithms  # noqa: F401  (registers the algorithms and their config sections)
    from alignkit.config.migrate import migrate_file

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


def register(sub: Any) -> None:
    sp = sub.add_parser("migrate", help="rewrite a config's HF TrainingArguments / seed-guide keys as alignkit keys")
    sp.add_argument("config", help="YAML run config")
    sp.add_argument("--out", default=None, help="write the native YAML here (default: stdout); comments are not kept")
    sp.set_defaults(func=cmd_migrate)
