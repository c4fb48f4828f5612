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
line as printed still runs), ``as A=B`` puts B for A in every line (a local stand-in for a Hub id)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

#: what a check block still runs (cheap, and what the other lines need)
CHECK_RUNS = ("tiny-model", "data", "validate", "train", "launch", "estimate")
MARK = re.compile(r"<!-- test: (.*?) -->\n```bash\n(.*?)```", flags=re.DOTALL)


@dataclass
class Block:
    page: str
    mode: str  # run | check
    lines: list[str]  # the block's commands, continuation lines joined
    extra: dict[str, list[str]] = field(default_factory=dict)  # subcommand -> args appended
    swaps: list[tuple[str, str]] = field(default_factory=list)

    def commands(self) -> list[tuple[str, list[str] | str]]:
        """``("alignkit", argv after alignkit)``, ``("parse", argv)`` or ``("bash", line)`` per line."""
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
            args = [*words[1:], *self.extra.get(words[1], [])]
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
