"""A tiny flow_grpo run through the CLI and ``alignkit generate`` on it (the micro SD3 pipeline, 2 optimizer steps):
the known-harmless library warnings and diffusers' progress bars stay out of the output, an EMA that a run is too
short to update is not what final/ holds, a run without final/ says what generate draws instead, and generate takes
the T5 length of the prompt encoding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, assert_ok, run_cli

pytest.importorskip("diffusers")

#: what a flow run printed before (issue 50): transformers' image-processor fallback, diffusers' LoRA note and bar
NOISE = ("requires torchvision", "No LoRA keys associated", "Loading pipeline components", "it/s]")


@pytest.fixture(scope="module")
def tiny_run(micro_sd3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """2 optimizer steps of flow_grpo with flow_grpo.ema on (ema_interval 8) in a fresh interpreter, its output
    captured (not a terminal); a prompt file for generate."""
    from alignkit.data.synth_vlm import generate_vlm

    root = tmp_path_factory.mktemp("flow-generate")
    train = generate_vlm(8, 0, root / "captions.json", stage="pretrain", split="train")
    out = root / "run"
    proc = run_cli(["train", str(REPO / "configs" / "flow_grpo.yaml"), f"model.name_or_path={micro_sd3}",
                    f"data.train={train}", f"output_dir={out}", "training.max_steps=2",
                    "training.global_batch_size=4", "training.per_device_batch_size=4", "rollout.num_generations=2",
                    "flow_grpo.num_inference_steps=2", "flow_grpo.ema=true", "checkpoint.save_steps=null",
                    "logging.plot=false"], fresh=True)
    assert_ok(proc)
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"prompt": "A red circle in the top left."}\n', encoding="utf-8")
    return {"proc": proc, "out": out, "prompts": prompts, "base": micro_sd3}


def _generate(target: Path, prompts: Path, out: Path, *extra: str, fresh: bool = False) -> Any:
    """``alignkit generate`` in a forked CLI child; ``fresh``: in a new interpreter (what it prints at import)."""
    proc = run_cli(["generate", str(target), str(prompts), "--out", str(out), "--num-inference-steps", "2",
                    "--resolution", "32", *extra], fresh=fresh)
    assert_ok(proc)
    return proc


def test_flow_train_and_generate_print_no_known_harmless_warnings_or_progress_bars(tiny_run: dict[str, Any],
                                                                                   tmp_path: Path) -> None:
    """Before: every flow command printed transformers' 'requires torchvision' fallback notes and diffusers'
    'Loading pipeline components' bar (and generate on a LoRA run 'No LoRA keys associated to
    CLIPTextModelWithProjection') into non-terminal output."""
    gen = _generate(tiny_run["out"] / "config.yaml", tiny_run["prompts"], tmp_path / "images", fresh=True)
    for proc in (tiny_run["proc"], gen):
        text = proc.stdout + proc.stderr
        assert not [line for line in text.splitlines() if any(n in line for n in NOISE)], text
    assert "Saved final model" in tiny_run["proc"].stdout + tiny_run["proc"].stderr


def test_a_run_too_short_for_an_ema_update_says_so_and_saves_the_trained_weights(tiny_run: dict[str, Any]) -> None:
    """ema_interval 8: the first EMA update comes after step 7, so 2 steps never update it. Before, final/ held the
    EMA as it started: the fresh LoRA, whose B matrices are zeros (the warm start exactly), and nothing was said."""
    from safetensors.torch import load_file

    text = tiny_run["proc"].stdout + tiny_run["proc"].stderr
    assert [line for line in text.splitlines() if "flow_grpo.ema: 2 optimizer steps make no EMA update" in line]
    lora = load_file(str(tiny_run["out"] / "final" / "pytorch_lora_weights.safetensors"))
    up = [t for name, t in lora.items() if "lora_B" in name or "lora.up" in name]
    assert up and any(t.abs().max() > 0 for t in up)


def test_generate_on_a_run_without_final_says_it_draws_the_start(tiny_run: dict[str, Any], tmp_path: Path) -> None:
    cfg = yaml.safe_load((tiny_run["out"] / "config.yaml").read_text(encoding="utf-8"))
    cfg["output_dir"] = str(tmp_path / "unfinished")
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    proc = _generate(config, tiny_run["prompts"], tmp_path / "images")
    lines = [x for x in proc.stderr.splitlines() if "holds no trained model" in x]
    assert len(lines) == 1 and f"drawing the run's start, {tiny_run['base']}" in lines[0], proc.stderr


def test_generate_takes_the_t5_length(tiny_run: dict[str, Any], tmp_path: Path) -> None:
    """A pipeline's default T5 length is 77, a run config's its flow_grpo.max_sequence_length (the recipe: 32):
    --max-sequence-length draws both with the same encoding (the same weights drawn at 77 and at 32 differ)."""
    base, prompts = tiny_run["base"], tiny_run["prompts"]
    default = _generate(base, prompts, tmp_path / "a")
    at_32 = _generate(base, prompts, tmp_path / "b", "--max-sequence-length", "32")
    assert "77 T5 tokens" in default.stdout and "32 T5 tokens" in at_32.stdout
    grid = "prompt-0000.png"
    assert (tmp_path / "a" / grid).read_bytes() != (tmp_path / "b" / grid).read_bytes()
