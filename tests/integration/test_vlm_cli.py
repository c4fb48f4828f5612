"""The VLM command surface: the shipped configs load (and ``--stage`` overrides their stage), a corrupt
image is one error line naming the file and the row, a text model is refused for vlm_sft in one line."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from alignkit.config import load_config
from alignkit.data.synth_vlm import generate_vlm, judge
from tests.conftest import REPO, run_cli


@pytest.mark.parametrize("name, stage, parts", [
    ("vlm_pretrain.yaml", "pretrain", ("projector",)),
    ("vlm_sft.yaml", "sft", ("projector", "language_model")),
])
def test_shipped_vlm_configs_load(name: str, stage: str, parts: tuple[str, ...]) -> None:
    from alignkit.algorithms import workload_of

    cfg = load_config(REPO / "configs" / name)
    assert cfg.algorithm == "vlm_sft" and cfg.vlm.stage == stage and cfg.data.image_root == "runs/data/shapes"
    (spec,) = workload_of(cfg).specs
    assert spec.kind == "vlm" and spec.train_parts == parts


def _one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [x for x in proc.stderr.splitlines() if x.startswith("alignkit: error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def test_stage_flag_and_a_corrupt_image_row(micro_llava: Path, micro_model: Path, tmp_path: Path) -> None:
    data = generate_vlm(3, 0, tmp_path / "sft.json", stage="sft", split="train")
    rows = json.loads(data.read_text())
    (tmp_path / rows[2]["image"]).write_bytes(b"GIF89a broken")
    common = [f"model.name_or_path={micro_llava}", f"data.train={data}", "data.image_root=null", f"output_dir={tmp_path / 'run'}",
              "training.max_steps=1", "training.global_batch_size=2"]
    line = _one_error_line(run_cli(["train", str(REPO / "configs" / "vlm_sft.yaml"), "--stage", "pretrain", *common]))
    # the stage flag reached the config (pretrain needs no projector_from) before the data was read
    assert f"{data}:3 field 'image': cannot read image" in line and rows[2]["image"] in line
    line = _one_error_line(run_cli(["train", str(REPO / "configs" / "vlm_pretrain.yaml"),
                                    f"model.name_or_path={micro_model}", *common[1:]]))
    assert "has no image processor with an image token" in line


def test_generate_answers_image_rows_with_a_vlm(micro_llava: Path, tmp_path: Path) -> None:
    """``alignkit generate MODEL rows.json``: a LLaVA model answers each image row after its last user turn."""
    from alignkit.cli import main

    data = generate_vlm(3, 0, tmp_path / "eval.json", stage="sft", split="eval")
    out = tmp_path / "gen.jsonl"
    assert main(["generate", str(micro_llava), str(data), "--out", str(out), "--max-new-tokens", "4"]) == 0
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["id"] for g in got] == [r["id"] for r in json.loads(data.read_text())]
    assert all(isinstance(g["completion"], str) for g in got)
    # the shapes judge scores each answer from the row's scene (the README's way to read the learning bar)
    scored = tmp_path / "scored.jsonl"
    assert main(["generate", str(micro_llava), str(data), "--out", str(scored), "--max-new-tokens", "4",
                 "--reward", "shapes_correct"]) == 0
    assert [json.loads(line)["score"] for line in scored.read_text().splitlines()] == [
        float(judge(r["scene"], r["conversations"][0]["value"], g["completion"]))
        for r, g in zip(json.loads(data.read_text()), got)]
