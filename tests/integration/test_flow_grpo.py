"""``algorithm: flow_grpo`` end to end through the CLI on the tiny SD3 pipeline taught the one-object shapes scenes
by flow_sft (the ``flow_warm`` session fixture): 2 gloo processes give the 1-process run (placement main: each
rank's images get their own rewards), a resume repeats the uninterrupted run (sampler noise included), and
training puts the asked colour in the asked cell more often (shapes_colour and shapes_hit rise)."""

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
    """2 prompts x 4 images per iteration, the recipe's 2 optimizer steps per iteration over disjoint halves of the
    images (rollout.mini_batches: the second with ratio != 1), guidance 2 and the KL term.
    A 1-process run of 2 iterations, and 2 DDP processes (4 images each, scored on rank 0 with placement main, each
    rank receiving its own images' rewards) resumed from its step-2 checkpoint: the second iteration's rewards,
    statistics, losses and gradient norms are the same (the sampler's noise is seeded by step and image, not by
    rank or by the RNG state; a rank given rank 0's rewards would change the gathered statistics).

    The clip range is opened (1.0 instead of the recipe's 1e-4) so that no ratio lies near a clip boundary: the two
    runs sum their gradients in another order (accumulation vs all-reduce), so the second update's ratios differ in
    the last bits, and at 1e-4 a ratio that close to 1 +- 1e-4 flips between clipped and not, which moves the
    gradient norm by a few percent while the loss stays equal (a CI run: grad_norm 0.02171 against 0.02235). The
    clipped loss itself is tested on fixed tensors in tests/unit."""
    common = [CONFIG, f"model.name_or_path={flow_warm['model']}", f"data.train={flow_warm['train']}",
              "training.max_steps=4", "training.global_batch_size=8", "training.per_device_batch_size=4",
              "rollout.num_generations=4", "rollout.update_epochs=1", "flow_grpo.num_inference_steps=3",
              "flow_grpo.guidance_scale=2.0", "flow_grpo.placement=main", "flow_grpo.clip_range=1.0",
              "checkpoint.save_steps=2", "checkpoint.save_total_limit=2", "logging.report_to=[jsonl]",
              "logging.plot=false"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert_ok(run_cli(["train", *common, f"output_dir={one}", "distributed.strategy=single",
                       "training.gradient_accumulation_steps=2"]))
    assert_ok(run_cli(["train", *common, f"output_dir={two}", "distributed.strategy=ddp",
                       f"checkpoint.resume_from={one / 'checkpoint-2'}"], nproc=2))
    a, b = _by_step(one), _by_step(two)
    assert sorted(a) == [2, 4] and sorted(b) == [4]  # one log line per iteration (its 2 optimizer steps)
    for k in ("reward_mean", "reward_std", "advantage_std", "advantage_abs_max", "loss", "grad_norm", "ratio", "kl",
              "approx_kl", "clip_fraction"):
        # the loss is a mean of terms of about +-1 (advantage x ratio) whose advantages sum to 0 in each group: it
        # cancels to ~2e-5, so its round-off is the terms' (fp32, ~1e-8 absolute: 2.0873e-05 against 2.0884e-05)
        tol = 1e-6 if k == "loss" else 1e-8
        assert a[4][k] == pytest.approx(b[4][k], rel=1e-4, abs=tol), (k, a[4][k], b[4][k])
    assert a[2]["reward_mean"] != a[4]["reward_mean"]  # another step: other prompts and noise
    # the second step of an iteration scores its half under a moved policy: ratios off 1 (none clipped at this
    # clip range), KL to the reference > 0
    assert a[2]["approx_kl"] > 0 and a[2]["clip_fraction"] == 0 and a[2]["kl"] > 0 and a[2]["advantage_std"] > 0


@pytest.mark.slow(seconds=40)  # two CLI runs on the micro pipeline
def test_flow_grpo_takes_two_optimizer_steps_per_rollout_the_second_off_policy(micro_sd3: Path, tmp_path: Path) -> None:
    """rollout.mini_batches (the shipped recipe's 2, as flow_grpo's two optimizer steps per epoch over disjoint halves
    of the samples): 4 optimizer steps are 2 iterations, one log line each; the second step of an iteration scores
    its half under the policy the first step moved, so the iteration's mean ratio is off 1 and some of its units are
    clipped. With 1 (one step over every image) the first iteration draws the same images and its ratio is exactly 1."""
    from alignkit.data.synth_vlm import generate_vlm

    train = generate_vlm(16, 0, tmp_path / "captions.json", stage="pretrain", split="train")
    common = [CONFIG, f"model.name_or_path={micro_sd3}", f"data.train={train}", "training.global_batch_size=8",
              "training.per_device_batch_size=8", "rollout.num_generations=4", "flow_grpo.num_inference_steps=2",
              "flow_grpo.eval_num_inference_steps=2", "training.learning_rate=1e-2",  # the micro policy moves past 1e-4
              "checkpoint.save_steps=null", "checkpoint.save_final=false", "logging.report_to=[jsonl]",
              "logging.plot=false"]
    proc = run_cli(["train", *common, f"output_dir={tmp_path / 'two'}", "training.max_steps=4"])
    assert_ok(proc)
    assert "4 steps in all (2 per iteration)" in proc.stdout + proc.stderr
    two = _by_step(tmp_path / "two")
    assert sorted(two) == [2, 4]
    assert_ok(run_cli(["train", *common, f"output_dir={tmp_path / 'one'}", "training.max_steps=2",
                       "rollout.mini_batches=1"]))
    one = _by_step(tmp_path / "one")
    assert sorted(one) == [1, 2]
    # one step over the images that policy drew, whose fresh LoRA (B = 0) is its KL base: ratio 1, KL 0
    assert one[1]["ratio"] == 1.0 and one[1]["clip_fraction"] == 0.0 and one[1]["kl"] == 0.0
    assert two[2]["reward_mean"] == one[1]["reward_mean"]  # the same first rollout
    for step in (2, 4):
        assert two[step]["ratio"] != 1.0 and two[step]["clip_fraction"] > 0, two[step]


def test_a_module_function_reward_is_handed_the_images_and_trains_the_run(micro_sd3: Path, tmp_path: Path) -> None:
    """A user's ``module:function`` as the one main reward (tests/plugins/image_reward.py: each image's mean
    brightness; it refuses a call without images). Before, it was handed the prompts and empty strings alone; now
    it gets the images, and its values are the run's reward (reward_mean = its per-scorer mean, within [0, 1])."""
    from alignkit.data.synth_vlm import generate_vlm

    train = generate_vlm(8, 0, tmp_path / "captions.json", stage="pretrain", split="train")
    fn = "tests.plugins.image_reward:brightness"
    out = tmp_path / "run"
    assert_ok(run_cli(["train", CONFIG, f"model.name_or_path={micro_sd3}", f"data.train={train}", f"output_dir={out}",
                       "training.max_steps=2", "training.global_batch_size=4", "training.per_device_batch_size=4",
                       "rollout.num_generations=2", "flow_grpo.num_inference_steps=2", f"flow_grpo.scorers=[{{name: '{fn}'}}]",
                       "checkpoint.save_steps=null", "checkpoint.save_final=false", "logging.report_to=[jsonl]",
                       "logging.plot=false"]))
    row = _by_step(out)[2]
    assert 0.0 < row[f"reward/main/{fn}"] < 1.0 and row["reward_mean"] == row[f"reward/main/{fn}"], row
    assert row["reward_std"] > 0, row  # the images differ in brightness: the advantages are not all zero


def _hits(target: Path, prompts: Path, out: Path, *extra: str) -> float:
    """The mean shapes_hit of ``alignkit generate``'s images of ``prompts`` (4 a prompt, ODE, fixed noise, the same
    settings for every target: the warm start's default T5 length is 77, the run's config says 32), drawn
    in a CLI child (one thread, a fresh process). Drawn in the test worker's own process, they can depend on what
    the tests run before in that worker left behind (thread count, global state): a full-suite run of the same
    code got 0.50 -> 0.55 where this file run alone passed."""
    assert_ok(run_cli(["generate", str(target), str(prompts), "--out", str(out), "--num-generations", "4",
                       "--num-inference-steps", "12", "--resolution", "32", "--guidance-scale", "1",
                       "--max-sequence-length", "32",  # the recipe's T5 length, for a pipeline and a run alike
                       "--reward", "shapes_hit", *extra]))
    scores = [s for x in (out / "images.jsonl").read_text().splitlines() for s in json.loads(x)["scores"]]
    return sum(scores) / len(scores)


@pytest.mark.slow(seconds=300)  # with the warm start (about 200 s)
def test_flow_grpo_puts_the_asked_colour_in_the_asked_cell(flow_warm: dict[str, Path], tmp_path: Path) -> None:
    """From the warm start (one shape a scene, of about the asked colour in the asked cell), 36 Flow-GRPO
    iterations (4 prompts x 8 images, 6 SDE steps; the recipe's 2 optimizer steps each over disjoint halves, the
    advantages over the batch's std) raise the shapes_colour reward of the training rollouts (first
    6 iterations vs last 6), and more of the images show the asked colour in the asked cell: shapes_hit of the
    rollouts (a weight-0 scorer: logged, not rewarded) and of the held-out prompts' images that ``alignkit
    generate`` draws with the same noise from the warm start and from the run (ODE, 4 a prompt)."""
    out = tmp_path / "run"
    proc = run_cli(["train", CONFIG, f"model.name_or_path={flow_warm['model']}", f"data.train={flow_warm['train']}",
                    f"data.eval={flow_warm['eval']}", f"output_dir={out}", "training.max_steps=72",
                    "training.eval_steps=1000", "training.learning_rate=1e-3", "checkpoint.save_steps=null",
                    "training.optimizer_impl=foreach",  # the bars below were measured with foreach AdamW
                    "flow_grpo.scorers=[{name: shapes_colour}, {name: shapes_hit, weight: 0}]",
                    "logging.report_to=[jsonl]", "logging.plot=false"])
    assert_ok(proc)
    rows = _rows(out)
    evals = [r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r]
    train = [r["reward_mean"] for r in rows if "loss" in r]
    hit = [r["reward/main/shapes_hit"] for r in rows if "loss" in r]
    assert len(evals) == 2 and len(train) == len(hit) == 36
    first = next(r for r in rows if "loss" in r)
    # the second step of an iteration scores its half under the policy the first step moved: clipped, KL > 0
    assert first["ratio"] != 1.0 and first["clip_fraction"] > 0 and first["kl"] > 0
    rise = sum(train[-6:]) / 6 - sum(train[:6]) / 6
    hit_first, hit_last = sum(hit[:6]) / 6, sum(hit[-6:]) / 6
    before = _hits(flow_warm["model"], flow_warm["eval"], tmp_path / "before")
    after = _hits(out / "config.yaml", flow_warm["eval"], tmp_path / "after")
    print(f"flow_grpo learning: rollouts' shapes_colour rise {rise:.3f}, shapes_hit {hit_first:.3f} -> {hit_last:.3f}; "
          f"held-out shapes_hit {before:.3f} -> {after:.3f}")
    # measured on two warm starts (tiny-model seed 0, the fixture's: held-out shapes_hit 0.391; seed 1: 0.578) and
    # training seeds 42 / 1 / 2 (seed 0's) and 42 / 1 (seed 1's): the rollouts' shapes_colour rose 0.057 / 0.048 /
    # 0.063 and 0.060 / 0.045; their shapes_hit went 0.85 -> 0.96 / 0.87 -> 0.99 / 0.81 -> 0.96 and 1.00 -> 1.00 /
    # 0.99 -> 1.00 (where it starts near 1 there is nothing left to rise: the bar is on the misses, which must at
    # least halve); the held-out images' shapes_hit 0.391 -> 0.547 / 0.656 / 0.766 and 0.578 -> 1.00 / 1.00. Warm
    # starts fitted in a test worker (its thread count varies: fixed since) gave 0.359 -> 0.703 and 0.656 -> 0.703.
    # Those warm starts varied from run to run because flow_sft seeded its noise by the data file's path (pytest's
    # numbered tmp folder); seeded by file name and line since, the fixture's warm start is the same in every run:
    # held-out shapes_hit 0.422, and training seeds 42 / 1 / 2 gave 0.422 -> 0.672 / 0.875 / 0.750, rollouts'
    # shapes_colour rise 0.062 / 0.046 / 0.067, shapes_hit 0.84 -> 0.96 / 0.87 -> 0.97 / 0.78 -> 0.98 (2026-11-27).
    # Those held-out numbers drew the warm start at T5 length 77 (generate's default for a pipeline) and the run at
    # 32 (its config's). Both drawn at 32 since (issue 50), training seeds 42 / 1 / 2 (rollouts' rise 0.062 / 0.046 /
    # 0.069, shapes_hit 0.84 -> 0.96 / 0.87 -> 0.98 / 0.78 -> 0.98): the warm start 0.3125, the runs 0.656 / 0.875 /
    # 0.734 (+0.34 to +0.56); at 77 seed 42 went 0.422 -> 0.734 (+0.31), compared as before 0.422 -> 0.656 (+0.23)
    # (2026-11-28). The held-out bar stays 0.023: the smallest rise measured is now 15 times it.
    # Bars: half the smallest rise of each over all of the above. eval/reward_mean (shapes_colour of the 16 held-out ODE images) rises a
    # little: the policy draws the asked colour larger, with other colours mixed in (docs/workflows/flow-grpo.md)
    assert rise > 0.02, (evals, train, hit, before, after)
    assert 1 - hit_last <= 0.5 * (1 - hit_first) + 0.01, (evals, train, hit, before, after)
    assert after - before > 0.023, (evals, train, hit, before, after)


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
