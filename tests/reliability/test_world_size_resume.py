"""A resume at another world size with a fixed per-device batch continues on exactly the unseen examples
of the epoch (issue: 2 -> 1 process repeated every example of the resumed steps; 1 -> 2 skipped 6)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import assert_ok, run_script

pytestmark = pytest.mark.distributed
WORKER = Path(__file__).parent / "record_examples.py"
N = 48  # examples in the epoch (data.max_train_examples), per-device batch 4


def seen(log_dir: Path) -> list[int]:
    return [i for f in sorted(log_dir.glob("rank*.jsonl")) for line in f.read_text().splitlines()
            for i in json.loads(line)["ids"]]


@pytest.mark.parametrize("first,second,stop,total", [(2, 1, 2, 10), (1, 2, 3, 8)])
def test_resume_at_another_world_size_sees_each_example_once(micro_model: Path, tmp_path: Path, first: int,
                                                             second: int, stop: int, total: int) -> None:
    """``first`` processes train ``stop`` steps (stop x 4 x first examples), the checkpoint is resumed by
    ``second`` processes up to step ``total``: exactly the rest of the epoch, each example once."""
    a_logs, b_logs = tmp_path / "a_logs", tmp_path / "b_logs"
    a_logs.mkdir(), b_logs.mkdir()
    a = tmp_path / "a"
    assert_ok(run_script(WORKER, nproc=first, timeout=300, args=[str(micro_model), str(a), str(a_logs), str(stop)]))
    b = tmp_path / "b"
    shutil.copytree(a / f"checkpoint-{stop}", b / f"checkpoint-{stop}")
    proc = run_script(WORKER, nproc=second, timeout=300,
                      args=[str(micro_model), str(b), str(b_logs), str(total), "latest"])
    assert_ok(proc)
    assert f"Effective batch changed on resume: {4 * first} " in proc.stderr
    before, after = seen(a_logs), seen(b_logs)
    assert len(before) == stop * 4 * first
    assert sorted(before + after) == sorted(set(before + after)) and len(before + after) == N, (before, after)
