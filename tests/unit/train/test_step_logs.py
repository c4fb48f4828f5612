"""The logs a run appends by step are rewound on resume (issue 50.14): metrics.jsonl and samples.jsonl, split on
newlines alone (a sampled completion may hold U+2028, which ``str.splitlines`` takes for a line end)."""

from __future__ import annotations

import json
from pathlib import Path

from alignkit.logging import RunLogger, truncate_metrics


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def test_truncate_keeps_rows_up_to_the_step_and_completions_with_line_separators(tmp_path: Path) -> None:
    rows = [{"step": s, "completion": f"a\u2028b\x85c {s}"} for s in (1, 1, 2, 3, 3)]
    path = tmp_path / "samples.jsonl"
    _write(path, rows)
    with path.open("a", encoding="utf-8") as fh:
        fh.write('{"step": 3, "compl')  # a row cut by a crash
    assert truncate_metrics(path, 2) == 3
    assert [json.loads(x) for x in path.read_text(encoding="utf-8").split("\n") if x] == rows[:3]
    assert truncate_metrics(path, 2) == 0


def test_a_resume_rewinds_every_step_log(tmp_path: Path) -> None:
    _write(tmp_path / "metrics.jsonl", [{"step": s, "loss": 1.0} for s in (1, 2, 3)])
    _write(tmp_path / "samples.jsonl", [{"step": s, "prompt": "p"} for s in (1, 1, 2, 2, 3, 3)])
    log = RunLogger(is_main=True, output_dir=tmp_path, report_to=["jsonl"])
    assert log.rewind_metrics(1) == {"metrics.jsonl": 2, "samples.jsonl": 4}
    log.log_metrics(2, {"loss": 0.5})
    log.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert [json.loads(x)["step"] for x in (tmp_path / "samples.jsonl").read_text().splitlines()] == [1, 1]
    other = RunLogger(is_main=False, output_dir=tmp_path, report_to=["jsonl"])
    assert other.rewind_metrics(0) == {}  # only rank 0 writes logs


def _tb_steps(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of one scalar as TensorBoard shows it: its own reader over every event file of the folder,
    which drops the events a later file's purge (SummaryWriter's ``purge_step``) orphaned."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_a_resume_rewinds_the_tensorboard_events(tmp_path: Path) -> None:
    """Before: the resumed run's events were appended to a new event file beside the old one, so TensorBoard showed
    steps 3 and 4 twice (the interrupted run's and the resumed run's). Now the writer is reopened with
    ``purge_step`` = the checkpoint's step + 1: the events after it are the resumed run's only."""
    import pytest

    pytest.importorskip("tensorboard")
    first = RunLogger(is_main=True, output_dir=tmp_path, report_to=["tensorboard"])
    for step in (1, 2, 3, 4):
        first.log_metrics(step, {"loss": float(step)})
    first.close()  # killed after step 4; its last checkpoint was step 2
    resumed = RunLogger(is_main=True, output_dir=tmp_path, report_to=["tensorboard"])
    resumed.rewind_metrics(2)
    for step in (3, 4, 5):
        resumed.log_metrics(step, {"loss": 10.0 * step})
    resumed.close()
    assert _tb_steps(tmp_path / "tensorboard", "loss") == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]
