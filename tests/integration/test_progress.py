"""Progress on long phases: a bar under a pseudo-terminal (even one that reports a 0 x 0 size), periodic
lines with rate and ETA in a log, and DPO's reference precompute limited to the rows the run reads."""

from __future__ import annotations

import logging
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from alignkit import progress
from tests.conftest import REPO, assert_ok, child_env, run_cli


def run_in_pty(args: list[str], timeout: int = 300) -> str:
    """``alignkit ARGS`` with stdin/stdout/stderr on a fresh pseudo-terminal (size 0 x 0, as `script` gives)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "alignkit", *args], stdin=slave, stdout=slave, stderr=slave,
                            env=child_env(), close_fds=True)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=timeout)
    os.close(master)
    assert proc.returncode == 0, b"".join(chunks).decode(errors="replace")[-3000:]
    return b"".join(chunks).decode(errors="replace")


def test_training_bar_under_a_pseudo_terminal(micro_model: Path, tmp_path: Path) -> None:
    out = run_in_pty(["train", str(REPO / "configs" / "sft.yaml"), f"model.name_or_path={micro_model}",
                      f"output_dir={tmp_path / 'run'}", "data.max_train_examples=32", "data.max_length=64",
                      "training.per_device_batch_size=4", "training.max_steps=4", "logging.plot=false"])
    assert "train: 100%" in out and "4/4" in out


def test_progress_lines_without_a_terminal(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)
    monkeypatch.setattr(progress, "QUIET_BELOW_S", 0.0)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    progress.configure(is_main=True, mode="auto")
    logger = logging.getLogger("alignkit")
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.INFO, logger="alignkit"):
        assert list(progress.track(range(4), 4, "precomputing reference log-probs", "batches")) == [0, 1, 2, 3]
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("precomputing reference log-probs: 1/4 (25%), ") and "batches/s, ETA" in lines[0]
    assert lines[-1].startswith("precomputing reference log-probs: 4/4 done in ")
    caplog.clear()
    progress.configure(is_main=False, mode="auto")  # other ranks stay silent
    with caplog.at_level(logging.INFO, logger="alignkit"):
        list(progress.track(range(3), 3, "x"))
    assert not caplog.records
    progress.configure(is_main=True, mode="auto")


def test_dpo_precomputes_only_the_rows_the_run_reads(micro_model: Path, tmp_path: Path) -> None:
    """2 steps x 8 pairs of a 2000-pair file: 16 train rows get reference log-probs, not 2000."""
    proc = run_cli(["train", str(REPO / "configs" / "dpo.yaml"), f"model.name_or_path={micro_model}",
                    f"output_dir={tmp_path / 'dpo'}", "dpo.precompute_ref_logps=true", "data.eval=[]",
                    "data.max_length=64", "training.per_device_batch_size=8", "training.max_steps=2",
                    "logging.report_to=[jsonl]", "logging.plot=false"])
    assert_ok(proc)
    assert "Precomputed reference log-probs (model) for 16 train and 0 eval pairs" in proc.stderr, proc.stderr[-2000:]
