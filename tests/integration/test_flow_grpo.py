"""``algorithm: flow_grpo`` end to end through the CLI on the micro SD3 pipeline taught the shapes scenes by
flow_sft (the ``flow_warm`` session fixture): 2 gloo processes give the 1-process run (placement main: each rank's
images get their own rewards), a resume repeats the uninterrupted run (sampler noise included), and the
shapes_colour reward rises over training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignkit.config import load_config
from tests.conftest import REPO, assert_ok, run_cli

pytest.importorskip("diffusers")

CONFIG = str(REPO / "configs" / "flow_grpo.yaml")


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _by_step(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in _rows(run) if "loss" in r}


def test_shipped_flow_grpo_config_declares_a_lora_diffusion_policy_and_its_base_as_reference() -> None:
    from alignkit.algorithms import workload_of

    cfg = load_config(REPO / "configs" / "flow_grpo.yaml")
    policy, reference = workload_of(cfg).specs
    assert cfg.algorithm == "flow_grpo" and policy.kind == "diffusion" and policy.trainable and policy.lora
    assert reference.role == "reference" and reference.shares == "policy"


def test_flow_grpo_two_processes_resumed_repeat_the_one_process_run(flow_warm: dict[str, Path], tmp_path: Path) -> None:
    """2 prompts x 4 images per iteration, 2 update epochs (the second with ratio != 1), guidance 2 and the KL term.
    A 1-process run of 2 iterations, and 2 DDP processes (4 images each, scored on rank 0 with placement main, each
    rank receiving its own images' rewards) resumed from its step-2 checkpoint: the second iteration's rewards,
    statistics, losses and gradient norms are the same (the sampler's noise is seeded by step and image, not by
    rank or by the RNG state; a rank given rank 0's rewards would change the gathered statistics)."""
    common = [CONFIG, f"model.name_or_path={flow_warm['model']}", f"data.train={flow_warm['train']}",
              "training.max_steps=4", "training.global_batch_size=8", "training.per_device_batch_size=4",
              "rollout.num_generations=4", "rollout.update_epochs=2", "flow_grpo.num_inference_steps=3",
              "flow_grpo.guidance_scale=2.0", "flow_grpo.placement=main", "checkpoint.save_steps=2",
              "checkpoint.save_total_limit=2", "logging.report_to=[jsonl]", "logging.plot=false"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert_ok(run_cli(["train", *common, f"output_dir={one}", "distributed.strategy=single",
                       "training.gradient_accumulation_steps=2"]))
    assert_ok(run_cli(["train", *common, f"output_dir={two}", "distributed.strategy=ddp",
                       f"checkpoint.resume_from={one / 'checkpoint-2'}"], nproc=2))
    a, b = _by_step(one), _by_step(two)
    assert sorted(a) == [2, 4] and sorted(b) == [4]  # one log line per iteration (its 2 updates)
    for k in ("reward_mean", "reward_std", "advantage_std", "advantage_abs_max", "loss", "grad_norm", "ratio", "kl",
              "clip_fraction"):
        assert a[4][k] == pytest.approx(b[4][k], rel=1e-4, abs=1e-8), (k, a[4][k], b[4][k])
    assert a[2]["reward_mean"] != a[4]["reward_mean"]  # another step: other prompts and noise
    # the second update of an iteration scores the samples under a moved policy: ratios off 1, some clipped, KL > 0
    assert a[2]["clip_fraction"] > 0 and a[2]["kl"] > 0 and a[2]["advantage_std"] > 0


@pytest.mark.slow
def test_flow_grpo_raises_the_shapes_colour_reward(flow_warm: dict[str, Path], tmp_path: Path) -> None:
    """From the flow_sft'ed micro pipeline, 36 Flow-GRPO iterations (4 prompts x 8 images, 6 SDE steps) raise the
    shapes_colour reward of the 16 held-out prompts rendered by the ODE sampler with the same noise before and after
    (eval/reward_mean), and of the training rollouts (first 6 iterations vs last 6)."""
    out = tmp_path / "run"
    proc = run_cli(["train", CONFIG, f"model.name_or_path={flow_warm['model']}", f"data.train={flow_warm['train']}",
                    f"data.eval={flow_warm['eval']}", f"output_dir={out}", "training.max_steps=36",
                    "training.eval_steps=1000", "training.learning_rate=1e-3", "checkpoint.save_steps=null",
                    "logging.report_to=[jsonl]", "logging.plot=false"])
    assert_ok(proc)
    rows = _rows(out)
    evals = [r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r]
    train = [r["reward_mean"] for r in rows if "loss" in r]
    assert len(evals) == 2 and len(train) == 36
    first = next(r for r in rows if "loss" in r)
    # the first update scores the samples under the policy that drew them, whose fresh LoRA (B = 0) is its base
    assert first["ratio"] == pytest.approx(1.0, abs=1e-6) and first["clip_fraction"] == 0.0 and first["kl"] == 0.0
    rise = sum(train[-6:]) / 6 - sum(train[:6]) / 6
    # measured with training.seed 42 / 1 / 2: eval -0.104 -> -0.039 / -0.105 -> -0.043 / -0.073 -> -0.041 (rise
    # 0.065 / 0.062 / 0.032), training rollouts +0.054 / +0.064 / +0.026; thresholds: half the smallest rise
    assert evals[1] - evals[0] > 0.016, (evals, train)
    assert rise > 0.013, (evals, train)


def test_generate_renders_a_grid_per_prompt_the_same_each_time(micro_sd3: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from alignkit.cli import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "A red circle in the top left."}\n{"caption": "A blue square in the top right."}\n')
    args = ["generate", str(micro_sd3), str(prompts), "--num-generations", "3", "--num-inference-steps", "2",
            "--resolution", "32", "--guidance-scale", "2", "--reward", "shapes_colour"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    assert main([*args, "--out", str(tmp_path / "b")]) == 0
    from PIL import Image

    rows = [json.loads(x) for x in (tmp_path / "a" / "images.jsonl").read_text().splitlines()]
    assert [r["grid"] for r in rows] == ["prompt-0000.png", "prompt-0001.png"]
    assert rows[1]["prompt"] == "A blue square in the top right." and len(rows[0]["scores"]) == 3
    for r in rows:
        assert Image.open(tmp_path / "a" / r["grid"]).size == (96, 32)
        assert (tmp_path / "a" / r["grid"]).read_bytes() == (tmp_path / "b" / r["grid"]).read_bytes()
    lora_only = tmp_path / "lora"
    lora_only.mkdir()
    (lora_only / "pytorch_lora_weights.safetensors").write_bytes(b"")
    capsys.readouterr()
    assert main(["generate", str(lora_only), str(prompts), "--out", str(tmp_path / "c")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a LoRA adapter alone; name its pipeline with --base" in err[0]
