"""A newcomer's path, run: the getting-started page's offline DPO block (a local tiny model standing in
for the Hub id) as the page shows it, in a fresh folder, shortened to a few steps; and `alignkit validate`
of the Hub-model command the page shows, on that stand-in."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from tests.conftest import REPO, assert_ok, run_cli

PAGE = REPO / "docs" / "getting-started.md"
#: appended to the page's `alignkit train` so the test takes seconds (later overrides win)
SHORT = ["training.max_steps=3", "data.max_eval_examples=8", "training.eval_steps=3", "logging.logging_steps=1"]


def offline_block() -> list[list[str]]:
    """The bash block that follows "Without network access" on the page, as argument lists."""
    text = PAGE.read_text(encoding="utf-8")
    tail = text[text.index("Without network access"):]
    block = re.search(r"```bash\n(.*?)```", tail, flags=re.S).group(1)
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def test_getting_started_offline_dpo_runs(tmp_path: Path) -> None:
    (tmp_path / "configs").symlink_to(REPO / "configs", target_is_directory=True)
    commands = offline_block()
    assert [c[:2] for c in commands] == [["alignkit", "tiny-model"], ["alignkit", "train"]]
    for tokens in commands:
        extra = SHORT if tokens[1] == "train" else []
        assert_ok(run_cli([*tokens[1:], *extra], cwd=tmp_path, timeout=600))
    run = tmp_path / "runs" / "dpo"
    assert (run / "final").is_dir() and (run / "metrics.jsonl").is_file()
    assert "rewards/accuracy" in (run / "metrics.jsonl").read_text(encoding="utf-8")
    # the Hub-model command of the page, with the stand-in in place of the Hub id: it validates
    hub = next(line for line in PAGE.read_text(encoding="utf-8").splitlines()
               if line.startswith("alignkit validate configs/dpo.yaml model.name_or_path=Qwen/"))
    args = [a if not a.startswith("model.name_or_path=") else "model.name_or_path=runs/tiny-model"
            for a in shlex.split(hub, comments=True)[1:]]
    proc = run_cli(args, cwd=tmp_path)
    assert_ok(proc)
    assert "chat_template" in proc.stdout + proc.stderr
