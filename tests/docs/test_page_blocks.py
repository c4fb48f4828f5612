"""Every workflow page (and getting started) holds a block a newcomer runs from an empty folder to a result, and
this test runs each marked block as printed, shortened by the overrides its mark names (``page_blocks.py``), so a
page cannot drift from the code (issue 42.4)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from alignkit.cli import build_parser
from tests.conftest import REPO, assert_ok, child_env, run_cli
from tests.docs.page_blocks import read_blocks

DOCS = REPO / "docs"
PAGES = [DOCS / "getting-started.md", *sorted((DOCS / "workflows").glob("*.md"))]
#: seconds per page on 2 cores under a load average of 15-19 (idle cores take less; the first page run also starts
#: run_cli's fork server): the 10 pages took 280 s in all there
COST = {"getting-started.md": 42, "sft.md": 31, "dpo.md": 25, "reward-cost.md": 29, "safe-dpo.md": 21,
        "online-rl.md": 29, "redteam.md": 30, "flow-grpo.md": 38, "vlm.md": 17, "kto-orpo.md": 13}


def test_every_page_has_a_run_block() -> None:
    """A block that runs from an empty folder, and each line of every marked block is a command the test runs."""
    for page in PAGES:
        blocks = read_blocks(page, DOCS)
        # getting started's offline block is run by tests/integration/test_docs_newcomer.py
        assert any(b.mode == "run" for b in blocks) or page.name == "getting-started.md", \
            f"{page.name}: no <!-- test: run ... --> block"
        for block in blocks:
            for kind, cmd in block.commands():
                assert kind == "alignkit" or not str(cmd).startswith(("torchrun", "python")), \
                    f"{page.name}: {cmd!r}: a launcher line belongs to alignkit launch in a check block"


@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.slow(seconds=COST.get(p.name, 60)), id=p.name)
                                  for p in PAGES])
def test_page_blocks_run(page: Path, tmp_path: Path) -> None:
    for name in ("configs", "scripts"):
        (tmp_path / name).symlink_to(REPO / name, target_is_directory=True)
    for block in read_blocks(page, DOCS):
        for kind, cmd in block.commands():
            if kind == "parse":
                build_parser().parse_args(list(cmd))
                continue
            if kind == "bash":
                proc = subprocess.run(["bash", "-c", str(cmd)], cwd=tmp_path, env=child_env(), capture_output=True,
                                      check=False, text=True, timeout=120)
            else:
                proc = run_cli(list(cmd), cwd=tmp_path, timeout=600)
            assert_ok(proc)
    # what a page writes goes under runs/ (models/ for the seed guides' Safe-RLHF chain): nothing in a clone's root
    left = sorted(p.name for p in tmp_path.iterdir())
    assert set(left) <= {"configs", "scripts", "runs", "models"}, f"{page.name}: its blocks wrote {left} (issue 42.7)"
    if any(b.mode == "run" for b in read_blocks(page, DOCS)):
        assert list(tmp_path.glob("runs/**/metrics.jsonl")) or list(tmp_path.glob("models/**/metrics.jsonl")), \
            f"{page.name}: the run blocks left no run"
