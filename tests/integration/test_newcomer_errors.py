"""A newcomer's mistakes end in one line (issue 42 points 1-3): a new run into another run's output_dir,
a model folder holding only a tokenizer, a LoRA target the model lacks, a text model given to flow_grpo,
GRPO-family estimators with one generation per prompt."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, assert_ok, run_cli
from tests.integration.test_bad_input_cli import one_error_line, train


def steps(out: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_new_run_into_a_used_output_dir_is_refused_and_loses_nothing(sft_config: dict[str, Any],
                                                                     tmp_path: Path) -> None:
    out = Path(sft_config["output_dir"])
    assert_ok(train(sft_config, tmp_path, training__max_steps=2, checkpoint__save_steps=1))
    # every file but the run lock (.alignkit.lock: the pid and host of the run holding the folder, rewritten by
    # each run that takes it, the refused one too; not data of the run)
    def files() -> dict[Path, bytes]:
        return {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".alignkit.lock"}

    before = files()
    assert steps(out) == [1, 2]

    line = one_error_line(train(sft_config, tmp_path))  # the same config again
    assert re.search(rf"output_dir '{re.escape(str(out))}' holds a run of sft \(metrics\.jsonl, 2 checkpoints up to "
                     r"checkpoint-2, latest\): resume with checkpoint\.resume_from=latest, or choose a new output_dir,"
                     r" or set checkpoint\.overwrite_output_dir=true \(moves that run to .*/run\.old-1\)$", line), line
    assert files() == before

    dpo = train(sft_config, tmp_path, algorithm="dpo", data__train="builtin:pref_train.jsonl")
    assert "holds a run of sft" in one_error_line(dpo)

    # resuming is the same run going on
    assert_ok(train(sft_config, tmp_path, training__max_steps=3, checkpoint__resume_from="latest"))
    assert steps(out) == [1, 2, 3]

    # the explicit overwrite moves the old run aside whole, and the new run logs from step 1 alone
    proc = train(sft_config, tmp_path, checkpoint__overwrite_output_dir=True)
    assert_ok(proc)
    aside = tmp_path / "run.old-1"
    assert f"moved the previous run of sft to {aside}" in proc.stderr
    assert steps(aside) == [1, 2, 3] and (aside / "checkpoint-2").is_dir()
    assert steps(out) == [1]


def test_demo_runs_twice(tmp_path: Path) -> None:
    """``alignkit demo`` twice into one folder: the second moves the first run aside instead of refusing."""
    out = tmp_path / "demo"
    args = ["demo", "--output-dir", str(out), "--size", "micro", "--max-steps", "1"]
    assert_ok(run_cli(args))
    proc = run_cli(args)
    assert_ok(proc)
    assert f"moved the previous run of sft to {out / 'sft.old-1'}" in proc.stderr
    # one run each: the untrained eval, a train row and an eval row
    assert steps(out / "sft") == steps(out / "sft.old-1") == [0, 1, 1]


@pytest.mark.parametrize("algorithm,command", [("grpo", "validate"), ("rloo", "train"), ("dr_grpo", "validate")])
def test_one_generation_per_prompt_is_refused_at_config_load(algorithm: str, command: str, micro_model: Path) -> None:
    """Zero advantages, zero gradients, a run to the end that learns nothing: refused before anything loads."""
    args = [command, str(REPO / "configs" / "grpo.yaml"), f"algorithm={algorithm}", f"model.name_or_path={micro_model}"]
    line = one_error_line(run_cli([*args, "rollout.num_generations=1"]))
    assert line == (f"alignkit: error: rollout.num_generations: 1 gives {algorithm} zero advantages (each completion "
                    "is its own group's mean), so nothing would train; use 2 or more (e.g. 8), or algorithm: ppo, "
                    "whose learned value baseline works with one completion per prompt"), line
    if command == "validate":
        assert_ok(run_cli([*args, "rollout.num_generations=2"]))


def test_a_model_folder_with_only_a_tokenizer_is_one_line(sft_config: dict[str, Any], micro_model: Path,
                                                          tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    tok.mkdir()
    for f in micro_model.glob("tokenizer*"):
        shutil.copy(f, tok / f.name)
    proc = train(sft_config, tmp_path, model__name_or_path=str(tok))
    assert one_error_line(proc) == (
        f"alignkit: error: model '{tok}': no config.json in this folder (it holds tokenizer.json, tokenizer_config.json)"
        ": a model folder holds config.json and weights, as save_pretrained or `alignkit tiny-model DIR` writes them")
    assert "Preparing" not in proc.stderr  # said before the data are read


def test_a_lora_target_the_model_lacks_is_one_line(sft_config: dict[str, Any], tmp_path: Path) -> None:
    line = one_error_line(train(sft_config, tmp_path, model__lora={"r": 4, "target_modules": ["q_proj", "qkv_proj"]}))
    assert line == ("alignkit: error: model.lora.target_modules: qkv_proj names no module of this LlamaForCausalLM; its "
                    "linear layers: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"), line


def test_a_text_model_given_to_flow_grpo_is_one_line(micro_model: Path, tmp_path: Path) -> None:
    proc = run_cli(["train", str(REPO / "configs" / "flow_grpo.yaml"), f"model.name_or_path={micro_model}",
                    f"output_dir={tmp_path / 'run'}", "training.max_steps=1"])
    line = one_error_line(proc)
    assert line == (f"alignkit: error: model '{micro_model}': not a diffusers pipeline folder (no model_index.json; it "
                    "holds a transformers model): this algorithm trains a text-to-image pipeline such as Stable "
                    "Diffusion 3.5 (a hub id, or `alignkit tiny-model --arch sd3 DIR` for a tiny one)"), line
    assert "sentencepiece" not in proc.stderr
