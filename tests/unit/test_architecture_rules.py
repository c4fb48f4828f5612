"""ARCHITECTURE.md rule 3: algorithms, losses and data never touch the distributed engine or name a device."""

from __future__ import annotations

import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "src" / "alignkit"
FORBIDDEN = re.compile(r"torch\.distributed|import deepspeed|from deepspeed|[\"']cuda[\"']|[\"']nccl[\"']|\.cuda\(")


def test_no_engine_or_device_names_in_algorithm_code() -> None:
    offenders = []
    for sub in ("algorithms", "losses", "data"):
        for f in sorted((PKG / sub).rglob("*.py")):
            for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), start=1):
                if FORBIDDEN.search(line):
                    offenders.append(f"{f.relative_to(PKG)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
    assert list((PKG / "algorithms").glob("*.py")), "the rule must look at real files"


def test_files_stay_small() -> None:
    big = [f"{f.relative_to(PKG)} ({n} lines)" for f in PKG.rglob("*.py")
           if (n := len(f.read_text(encoding="utf-8").splitlines())) > 600]
    assert not big, big
