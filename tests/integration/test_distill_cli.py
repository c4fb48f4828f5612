"""On-policy distillation (``configs/distill.yaml``) through the CLI on the micro model.

- Teacher = student (the micro model both): the per-token divergence of the first step is 0 (the same weights,
  dropout off), and the run trains and saves.
- A teacher of another vocabulary (a micro model with a 300-token tokenizer) is refused in one line, exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignkit.models.tiny import build_tiny_model
from tests.conftest import REPO, assert_ok, run_cli


def args(model: Path, teacher: Path, out: Path, *extra: str) -> list[str]:
    return ["train", str(REPO / "configs" / "distill.yaml"), f"model.name_or_path={model}",
            f"distill.teacher={teacher}", f"output_dir={out}", "training.max_steps=2", "training.per_device_batch_size=8",
            "data.eval=[]", "logging.plot=false", "logging.logging_steps=1", *extra]


@pytest.mark.slow(seconds=40)
def test_distill_trains_and_a_teacher_equal_to_the_student_has_zero_divergence(micro_model: Path, tmp_path: Path):
    assert_ok(run_cli(args(micro_model, micro_model, tmp_path / "run")))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "distill_divergence" in r]
    assert len(logged) == 2 and abs(logged[0]["distill_divergence"]) < 1e-6, logged
    assert logged[1]["distill_divergence"] > 0  # the first step moved the student away from its own copy
    assert (tmp_path / "run" / "final" / "config.json").is_file()


@pytest.mark.slow(seconds=40)
def test_distill_refuses_a_teacher_of_another_vocabulary(micro_model: Path, tmp_path: Path):
    other = build_tiny_model(tmp_path / "other", size="micro", vocab_size=300, seed=1)
    proc = run_cli(args(micro_model, other, tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "distill.teacher" in last and "tokenizer" in last, last
