"""ORPO and KTO through the CLI on the micro model: train with accumulation, exact resume, eval, bad rows.

- ``configs/orpo.yaml`` / ``configs/kto.yaml`` with gradient accumulation 2 (KTO: z0 over both
  micro-batches): the seed-style step line, a run stopped at step 2 and resumed to 4 has the straight
  run's losses, and ``alignkit eval`` of ``final/`` gives the run's last evaluation.
- A KTO row without its desirability label, and an ORPO row without a chosen response, are one-line
  errors naming the file and line.
- KTO data with desirable rows only (or undesirable only) is refused in one line at start-up; the Eq. 8 imbalance
  warning counts the whole data set, not the first micro-batches.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, assert_ok, run_cli

#: what each algorithm's console step line shows (the seed-style names, as DPO's)
STEP_LINE = {"orpo": ("rewards/chosen=", "rewards/accuracy=", "nll=", "log_odds_ratio="),
             "kto": ("rewards/chosen=", "rewards/rejected=", "kl=", "logps/chosen=")}


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def args(algorithm: str, model: Path, out: Path, *extra: str) -> list[str]:
    return [str(REPO / "configs" / f"{algorithm}.yaml"), f"model.name_or_path={model}", f"output_dir={out}",
            "data.max_train_examples=32", "data.max_eval_examples=10", "data.max_length=64",
            "training.per_device_batch_size=2", "training.gradient_accumulation_steps=2",
            "training.learning_rate=5e-3", "training.lr_scheduler=constant", "training.warmup_ratio=0",
            "training.eval_steps=100", "checkpoint.save_steps=2", "logging.logging_steps=1",
            "logging.report_to=[console,jsonl]", *extra]


@pytest.mark.slow(seconds=60)
@pytest.mark.parametrize("algorithm", ["orpo", "kto"])
def test_train_resume_eval(micro_model: Path, tmp_path: Path, algorithm: str) -> None:
    straight, out = tmp_path / "straight", tmp_path / "run"
    proc = run_cli(["train", *args(algorithm, micro_model, straight, "training.max_steps=4")])
    assert_ok(proc)
    step_lines = [line for line in proc.stderr.splitlines() if " step 4 loss=" in line]
    assert step_lines and all(k in step_lines[0] for k in STEP_LINE[algorithm]), proc.stderr[-2000:]
    assert_ok(run_cli(["train", *args(algorithm, micro_model, out, "training.max_steps=2")]))
    proc = run_cli(["train", *args(algorithm, micro_model, out, "training.max_steps=4", "checkpoint.resume_from=latest")])
    assert_ok(proc)
    assert "Resumed from" in proc.stderr
    a = [m["loss"] for m in metrics(straight) if "loss" in m]
    b = [m["loss"] for m in metrics(out) if "loss" in m]
    assert len(a) == 4 and len(b) == 4 and len(set(a)) > 1
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)

    proc = run_cli(["eval", *args(algorithm, micro_model, out), "--model", str(out / "final"),
                    "--out", str(tmp_path / "eval.json")])
    assert_ok(proc)
    got = json.loads((tmp_path / "eval.json").read_text())
    last = [m for m in metrics(out) if "eval/loss" in m][-1]
    for key in ("loss", "rewards/chosen", "rewards/rejected"):
        assert abs(got[key] - last[f"eval/{key}"]) < 1e-5, key


@pytest.mark.parametrize("algorithm, row, message", [
    ("kto", {"prompt": "What is 1+1?", "completion": "2"},
     ":3: a KTO row needs a desirability label 'label' (true = desirable, false = undesirable) beside 'prompt' "
     "and 'completion' (row has ['completion', 'prompt'])"),
    ("orpo", {"prompt": "What is 1+1?", "rejected": "3"}, ":3: missing field 'chosen' (row has ['prompt', 'rejected'])"),
])
def test_bad_row_is_one_line_naming_file_and_line(micro_model: Path, tmp_path: Path, algorithm: str, row: dict,
                                                   message: str) -> None:
    good = ([{"prompt": "What is 2+2?", "completion": "4", "label": True}] * 4 if algorithm == "kto" else
            [{"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"}] * 4)
    rows = good[:2] + [row] + good[2:]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    proc = run_cli(["train", *args(algorithm, micro_model, tmp_path / "x", f"data.train={path}", "data.eval=[]",
                                   "training.max_steps=1")])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == f"alignkit: error: {path}{message}"
    assert "Traceback" not in proc.stderr


def kto_rows(path: Path, desirable: int, undesirable: int) -> Path:
    rows = [{"prompt": f"What is {i}+{i}?", "completion": str(2 * i), "label": i < desirable}
            for i in range(desirable + undesirable)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize("label", [True, False])
def test_kto_one_sided_data_is_one_line(micro_model: Path, tmp_path: Path, label: bool) -> None:
    """Before, desirable rows alone trained and logged logps/rejected=nan without a word."""
    path = kto_rows(tmp_path / "rows.jsonl", 8 if label else 0, 0 if label else 8)
    proc = run_cli(["train", *args("kto", micro_model, tmp_path / "x", f"data.train={path}", "data.eval=[]",
                                   "training.max_steps=1")])
    assert proc.returncode == 2, proc.stderr[-2000:]
    kind, other = ("desirable", "undesirable") if label else ("undesirable", "desirable")
    assert proc.stderr.strip().splitlines()[-1] == (
        f"alignkit: error: data.train: all 8 completions are {kind} (label {str(label).lower()}); KTO needs {other} "
        f"ones too (label {str(not label).lower()}), else their loss and metrics are undefined (NaN)")
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "x" / "metrics.jsonl").read_text()  # refused before any step


def test_kto_imbalance_warning_counts_the_whole_data_set(micro_model: Path, tmp_path: Path) -> None:
    """12 desirable and 4 undesirable rows, one step of 4 completions: before, the warning counted the 4 the step
    read (``examples_used``), not the data's 16."""
    path = kto_rows(tmp_path / "rows.jsonl", 12, 4)
    proc = run_cli(["train", *args("kto", micro_model, tmp_path / "x", f"data.train={path}", "data.eval=[]",
                                   "training.max_steps=1")])
    assert_ok(proc)
    lines = [x for x in proc.stderr.splitlines() if "desirable and" in x]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert ("kto: data.train holds 12 desirable and 4 undesirable completions; desirable_weight x 12 / "
            "(undesirable_weight x 4) = 3.00, outside [1, 4/3] (KTO paper Eq. 8): e.g. set kto.desirable_weight=0.33"
            in lines[0]), lines
