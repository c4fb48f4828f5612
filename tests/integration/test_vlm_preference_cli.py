"""Image + text preference rows through the command line with a tiny LLaVA, no algorithm-specific path:
``alignkit data synth --kind vlm --stage preference|beavertails_v`` -> a Helpful-RM (reward_model) and a
Harmless-RM (cost_model) on image rows (``alignkit score`` scores BeaverTails-V rows with it) -> Safe-MM-DPO with both frozen, its J_C estimated on image prompts
-> DPO with LoRA (adapters saved alone). Each final model loads back and scores / generates with images."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import assert_ok, run_cli


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("vpref")
    assert_ok(run_cli(["data", "synth", "--kind", "vlm", "--stage", "preference", "--split", "train", "--n", "24",
                       "--out", str(d / "train.jsonl")]))
    assert_ok(run_cli(["data", "synth", "--kind", "vlm", "--stage", "beavertails_v", "--split", "eval", "--n", "8",
                       "--seed", "1", "--out", str(d / "eval.jsonl")]))
    return d


def _train(micro_llava: Path, rows: Path, out: Path, algorithm: str, *over: str) -> Path:
    from alignkit.cli import main
    from tests.conftest import write_config

    config = write_config(out.parent / f"{out.name}.yaml", {
        "model": {"name_or_path": str(micro_llava)},
        "data": {"train": str(rows / "train.jsonl"), "eval": str(rows / "eval.jsonl"), "max_length": 128},
        "training": {"per_device_batch_size": 4, "max_steps": 3, "eval_steps": 3, "learning_rate": 1e-3},
        "logging": {"report_to": ["jsonl"], "plot": False, "logging_steps": 1}, "distributed": {"strategy": "single"},
        "output_dir": str(out)})
    assert main(["train", str(config), "--algorithm", algorithm, *over]) == 0
    return out


def test_reward_cost_safe_dpo_and_lora_dpo_on_image_rows(micro_llava: Path, rows: Path, tmp_path: Path) -> None:
    from transformers import AutoProcessor

    from alignkit.models.scalar import load_scorer
    from alignkit.rewards.scalar import EstimatePrompt, score_responses
    from alignkit.rollout.vlm_generate import load_vlm_for_generation

    rm = _train(micro_llava, rows, tmp_path / "rm", "reward_model")
    cm = _train(micro_llava, rows, tmp_path / "cm", "cost_model")
    for run, key in ((rm, "eval/accuracy"), (cm, "eval/sign_accuracy")):
        assert any(key in m for m in _metrics(run)), run
        assert (run / "final" / "processor_config.json").is_file()  # the processor travels with the model

    # the frozen scorers load back (alignkit registers LLaVA's scoring class) and score image + text
    scorer, tok = load_scorer(rm / "final")
    processor = AutoProcessor.from_pretrained(rm / "final")
    first = json.loads((rows / "train.jsonl").read_text().splitlines()[0])
    prompt = EstimatePrompt(first["prompt"], [str(rows / first["image"])])
    scores = score_responses(scorer, tok, [prompt, prompt], [first["response_0"], first["response_1"]],
                             chat_template=True, max_length=128, device=torch.device("cpu"), processor=processor)
    assert scores.shape == (2,) and torch.isfinite(scores).all()
    # `alignkit score` on BeaverTails-V rows: each response scored with its image, as in training
    from alignkit.cli import main

    assert main(["score", str(rm / "final"), str(rows / "eval.jsonl"), "--out", str(tmp_path / "scores.jsonl")]) == 0
    scored = [json.loads(line) for line in (tmp_path / "scores.jsonl").read_text().splitlines()]
    assert len(scored) == 8 and all(isinstance(r["response_1_score"], float) and "response_2_score" in r for r in scored)

    sd = _train(micro_llava, rows, tmp_path / "sd", "safe_dpo", f"safe_dpo.helpful_model={rm / 'final'}",
                f"safe_dpo.cost_model={cm / 'final'}", "safe_dpo.cost_eval_every=1", "safe_dpo.cost_eval_prompts=4",
                "safe_dpo.cost_max_new_tokens=4", "safe_dpo.sign_check_rows=0")
    steps = [m for m in _metrics(sd) if "loss_H" in m]
    assert len(steps) == 3 and all({"loss_S", "lambda", "J_C"} <= set(m) for m in steps)
    assert len({m["J_C"] for m in steps}) > 1  # a fresh estimate from image prompts every step
    model, _ = load_vlm_for_generation(str(sd / "final"))
    assert type(model).__name__ == "LlavaForConditionalGeneration"

    lora = _train(micro_llava, rows, tmp_path / "dpo", "dpo", "model.lora.r=4", "model.lora.alpha=8")
    assert (lora / "final" / "adapter_config.json").is_file() and not (lora / "final" / "model.safetensors").exists()
    evals = [m for m in _metrics(lora) if "eval/rewards/accuracy" in m]
    assert evals and all(0.0 <= m["eval/rewards/accuracy"] <= 1.0 for m in evals)
    model, processor = load_vlm_for_generation(str(lora / "final"))
    assert processor.image_token_id is not None
