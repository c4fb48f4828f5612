"""What counts as another run in an output_dir (issue 42.1): logged steps, checkpoints, latest, a final or
epoch model; a folder a run left before its first logged step is free again."""

from __future__ import annotations

from pathlib import Path

import pytest

from alignkit.config import RunConfig, load_config
from alignkit.errors import ConfigError
from alignkit.train.output_dir import aside_path, check_reuse, run_algorithm, run_marks


def config(out: Path, *extra: str) -> RunConfig:
    return load_config(None, ["model.name_or_path=m", "data.train=builtin:sft_train.jsonl",
                              "training.per_device_batch_size=1", f"output_dir={out}", *extra])


def test_a_folder_left_before_the_first_logged_step_is_no_run(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("algorithm: dpo\n")
    (tmp_path / "metrics.jsonl").write_text("")
    assert run_marks(tmp_path) == [] and run_marks(tmp_path / "absent") == []
    assert check_reuse(config(tmp_path)) is None


def test_marks_algorithm_and_the_refusal(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("algorithm: dpo\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "final").mkdir()
    (tmp_path / "epoch_1").mkdir()
    assert run_marks(tmp_path) == ["metrics.jsonl", "epoch_1/", "final/"]
    assert run_algorithm(tmp_path) == "dpo"
    with pytest.raises(ConfigError, match=r"holds a run of dpo \(metrics\.jsonl, epoch_1/, final/\): resume with"):
        check_reuse(config(tmp_path))
    assert check_reuse(config(tmp_path, "checkpoint.resume_from=latest")) is None  # the same run goes on
    with pytest.raises(ConfigError, match="holds a run of dpo"):  # weights only: a new run
        check_reuse(config(tmp_path, f"checkpoint.resume_from={tmp_path}", "checkpoint.resume_weights_only=true"))


def test_overwrite_moves_the_folder_aside_whole(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "notes.txt").write_text("mine")
    (tmp_path / "run.old-1").mkdir()  # taken: the next number is used
    assert aside_path(out) == tmp_path / "run.old-2"
    line = check_reuse(config(out, "checkpoint.overwrite_output_dir=true"))
    assert line == f"output_dir: moved the previous run to {tmp_path / 'run.old-2'} (checkpoint.overwrite_output_dir)"
    assert not out.exists() and (tmp_path / "run.old-2" / "notes.txt").read_text() == "mine"
