"""The pages' marked command blocks, read and run as a reader would type them (issue 42.4).

A block is marked by the HTML comment on the line before its fence (invisible on the site)::

    <!-- test: run | train training.max_steps=2 | data --n 64 | as Qwen/Qwen2.5-0.5B-Instruct=runs/tiny-model -->
    ```bash
    ...
    ```

The first word says what the test does with it: ``run`` runs every line in an empty folder (with the repository's
``configs/`` and ``scripts/`` beside it, as in a clone); ``check`` runs it too but an ``alignkit train`` line
becomes ``alignkit validate``, ``alignkit launch`` gets ``--dry-run`` and a line that reads a trained run
(``plot``, ``eval``, ``generate``, ...) is parsed by the CLI's parser only (the block of a real model, of many
GPUs, or one another test trains: its text is checked, nothing trains). The other ``|`` pieces shorten it:
``SUBCOMMAND ARGS`` appends ARGS to each ``alignkit SUBCOMMAND`` line (a later override or option wins, so the
line as printed still runs), ``as A=B`` puts B for A in every line (a local stand-in for a Hub id).

A page that says how long its blocks take says it as "... as written takes about N minutes ..." (:data:`STATED`):
``test_page_blocks.py`` holds each such page's measured time and checks the statement against it
(:func:`estimate_error`); with ``ALIGNKIT_DOCS_AS_WRITTEN=1`` it runs the run blocks as printed and checks the
statement against the time it measures."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

#: what a check block still runs (cheap, and what the other lines need)
CHECK_RUNS = ("tiny-model", "data", "validate", "train", "launch", "estimate")
MARK = re.compile(r"<!-- test: (.*?) -->\n```bash\n(.*?)```", flags=re.DOTALL)
#: how a page states the time of its run blocks as printed: "... as written takes about 2 minutes ..." (or took,
#: a range "2-3 minutes"); :func:`stated_minutes` reads it
STATED = re.compile(r"as written (?:took|takes) (?:about )?(\d+(?:\.\d+)?)(?:-(\d+(?:\.\d+)?))? minutes?")
#: a stated estimate may be LONGER_AT_MOST times the measured time at most, and at least its 1 / SHORTER_AT_MOST
#: (machines and their load vary: generous)
LONGER_AT_MOST, SHORTER_AT_MOST = 3.0, 2.0


def stated_minutes(text: str) -> tuple[float, float] | None:
    """The (low, high) minutes a page states for its blocks as written, or None where it states none."""
    found = STATED.findall(" ".join(text.split()))
    assert len(found) <= 1, f"one stated time a page, found {found}"
    if not found:
        return None
    lo, hi = found[0]
    return float(lo), float(hi or lo)


def estimate_error(stated: tuple[float, float], measured_s: float) -> str | None:
    """Why a stated (low, high) minutes is off the measured seconds by more than the factors above; None if not."""
    minutes = measured_s / 60
    if stated[1] > LONGER_AT_MOST * minutes:
        return f"states {stated[1]:g} minutes, more than {LONGER_AT_MOST:g} x the measured {minutes:.1f}"
    if stated[0] < minutes / SHORTER_AT_MOST:
        return f"states {stated[0]:g} minutes, less than the measured {minutes:.1f} / {SHORTER_AT_MOST:g}"
    return None


@dataclass
class Block:
    page: str
    mode: str  # run | check
    lines: list[str]  # the block's commands, continuation lines joined
    extra: dict[str, list[str]] = field(default_factory=dict)  # subcommand -> args appended
    swaps: list[tuple[str, str]] = field(default_factory=list)

    def commands(self, as_written: bool = False) -> list[tuple[str, list[str] | str]]:
        """``("alignkit", argv after alignkit)``, ``("parse", argv)`` or ``("bash", line)`` per line; ``as_written``:
        without the mark's shortening arguments (its ``as`` stand-ins stay)."""
        out: list[tuple[str, list[str] | str]] = []
        for line in self.lines:
            for a, b in self.swaps:
                line = line.replace(a, b)
            words = shlex.split(line, comments=True)
            if not words:
                continue
            if words[0] != "alignkit":
                out.append(("bash", line))
                continue
            args = [*words[1:], *([] if as_written else self.extra.get(words[1], []))]
            if self.mode == "check" and args[0] == "train":
                args[0] = "validate"
            elif self.mode == "check" and args[0] == "launch":
                args.insert(1, "--dry-run")
            elif self.mode == "check" and args[0] not in CHECK_RUNS:
                out.append(("parse", args))  # it reads a run a check does not train: its arguments are checked
                continue
            out.append(("alignkit", args))
        return out


def read_blocks(page: Path, root: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    blocks = []
    for spec, body in MARK.findall(text):
        pieces = [p.strip() for p in spec.split("|")]
        mode, *rest = pieces
        assert mode in ("run", "check"), f"{page.name}: a test mark starts with run or check, got {mode!r}"
        block = Block(str(page.relative_to(root)), mode, body.replace("\\\n", " ").splitlines())
        for piece in rest:
            word, _, args = piece.partition(" ")
            if word == "as":
                a, _, b = args.partition("=")
                block.swaps.append((a.strip(), b.strip()))
            else:
                block.extra[word] = shlex.split(args)
        blocks.append(block)
    return blocks
