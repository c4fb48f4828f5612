"""benchmarks/recipe_identity.py: every shipped config has a recipe, timing keys are dropped and numbers kept,
--compare tells identical from differing runs (exit 1), and one recipe runs end to end through the CLI."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "benchmarks" / "recipe_identity.py"


@pytest.fixture(scope="module")
def ri() -> SimpleNamespace:
    return SimpleNamespace(**runpy.run_path(str(SCRIPT)))


def test_every_shipped_config_has_a_recipe(ri: SimpleNamespace) -> None:
    assert set(ri.RECIPES) == {p.stem for p in (REPO / "configs").glob("*.yaml")}
    assert ri.with_deps(["vlm_sft", "grpo"]) == ["sft_digits", "grpo", "vlm_pretrain", "vlm_sft"]
    # a subset builds only the parts it starts from (the end-to-end test below: the Llama alone), every recipe all
    assert ri.parts_used(ri.with_deps(["orpo"])) == {"lm"} and ri.parts_used(list(ri.RECIPES)) == set(ri.PARTS)
    assert ri.parts_used(["redteam"]) == {"lm", "prompts", "tox"}
    assert ri.parts_used(["flow_rtpo"]) == {"lm", "llava", "sd3", "prompts", "tox", "clip"}


def test_timing_keys_dropped_numbers_kept(ri: SimpleNamespace) -> None:
    row = {"time": 1.0, "time/update_s": 0.1, "rollout_s": 0.2, "image/sample_s": 0.3, "tokens_per_s": 9.0,
           "gen_tokens_per_s": 8.0, "peak_mem_mb": 400.0, "loss_S": 0.5, "accuracy_S": 1.0, "beta_H": 0.1,
           "J_C": 2.0, "step": 3, "eval/beta_S": 0.2}
    assert ri.untimed(row) == {"loss_S": 0.5, "accuracy_S": 1.0, "beta_H": 0.1, "J_C": 2.0, "step": 3,
                               "eval/beta_S": 0.2}


def _write(path: Path, recipes: dict) -> Path:
    path.write_text(json.dumps({"recipes": recipes}))
    return path


def test_compare_reports_the_first_difference(ri: SimpleNamespace, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5, "kl": 0.1}]
    a = _write(tmp_path / "a.json", {"sft": rows, "dpo": rows})
    assert ri.compare(a, _write(tmp_path / "same.json", {"sft": rows, "dpo": rows})) == 0
    assert "sft: identical (2 rows)" in capsys.readouterr().out
    changed = [rows[0], {**rows[1], "kl": 0.2}]
    assert ri.compare(a, _write(tmp_path / "b.json", {"sft": rows, "dpo": changed})) == 1
    out = capsys.readouterr().out
    assert "dpo: DIFFERS in kl; first: row 1 (step 2) kl: 0.1 vs 0.2" in out and "sft: identical" in out
    assert ri.compare(a, _write(tmp_path / "c.json", {"sft": rows})) == 1
    assert "dpo: only in" in capsys.readouterr().out
    assert ri.compare(a, _write(tmp_path / "d.json", {"sft": rows, "dpo": rows[:1]})) == 1
    assert "2 rows vs 1" in capsys.readouterr().out


@pytest.mark.slow(seconds=20)
def test_one_recipe_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "orpo.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--only", "orpo", "--out", str(out),
                           "--work", str(tmp_path / "work")], check=False,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["recipes"]["orpo"]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 3]  # eval at 0 and at the end, 3 training steps
    assert all("time" not in r and "tokens_per_s" not in r for r in rows) and "loss" in rows[1]
    again = subprocess.run([sys.executable, str(SCRIPT), "--compare", str(out), str(out)], check=False,
                           capture_output=True, text=True)
    assert again.returncode == 0 and "orpo: identical (5 rows)" in again.stdout
