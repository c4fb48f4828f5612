"""``alignkit train configs/flow_rtpo.yaml`` end to end on tiny models: the micro Llama attacker (LoRA) rewrites
seed prompts, the micro SD3 pipeline (LoRA, the ``image_policy`` role) renders every attack with the SDE sampler,
the micro LLaVA continues the template on the image, a tiny random multi-label classifier scores the toxicity of
its text and a tiny random CLIP the quality of image and attack; both policies train from one reward in one run.
One process with an exact resume; under ``accelerate launch`` with 2 processes and the 2-node loopback form, both
equal to one process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from alignkit.data.synth import make_prompt_rows, write_rows
from tests.conftest import REPO, assert_ok, jsonl, run_cli
from tests.plugins.redteam_parts import build_classifier, build_clip, tiny_train_args

pytest.importorskip("diffusers")

CONFIG = str(REPO / "configs" / "flow_rtpo.yaml")
W_CVAR, W_QUALITY_ATTACKER, W_QUALITY_IMAGE = 0.5, 0.2, 0.7  # the two policies' rewards differ in their weights


@pytest.fixture(scope="module")
def parts(micro_model: Path, micro_llava: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("flow_rtpo")
    labels = ["toxic", "severe_toxic", "obscene", "threat", "insult", "identity_hate"]
    return {"classifier": Path(build_classifier(str(root / "tox"), str(micro_model), labels, multi_label=True)),
            "clip": Path(build_clip(str(root / "clip"), str(micro_llava))),
            "train": write_rows(make_prompt_rows(8, seed=0), root / "train.jsonl"),
            "eval": write_rows(make_prompt_rows(2, seed=1), root / "eval.jsonl")}


def flow_rtpo_args(out: Path, models: dict[str, Path], parts: dict[str, Path], nproc: int, *extra: str) -> list[str]:
    """A 2-iteration Flow-RTPO run: 4 attacks (2 seeds x 2) per iteration split over ``nproc`` processes, each
    rendered once (``extra`` may say ``flow_rtpo.images_per_attack``) at 32 px with 3 SDE steps (2 trained)."""
    args = tiny_train_args(CONFIG, str(out), str(models["lm"]), str(parts["train"]), str(parts["eval"]), nproc,
                           generations=2, batch=4, max_new_tokens=6)
    scorers = (f"[{{name: toxicity, model: '{parts['classifier']}'}}, "
               f"{{name: clip_quality, use: quality, model: '{parts['clip']}'}}]")
    return [*args, f"flow_rtpo.image_model={models['sd3']}", f"redteam.target.model={models['llava']}",
            "redteam.target.max_new_tokens=6", f"redteam.scorers={scorers}", f"redteam.w_cvar={W_CVAR}",
            f"redteam.w_quality={W_QUALITY_ATTACKER}", f"flow_grpo.w_cvar={W_CVAR}",
            f"flow_grpo.w_quality={W_QUALITY_IMAGE}", "flow_grpo.resolution=32", "flow_grpo.num_inference_steps=3",
            "flow_grpo.eval_num_inference_steps=3", "flow_grpo.guidance_scale=1.0", "flow_grpo.max_sequence_length=32",
            "flow_rtpo.image_learning_rate=1e-3", "flow_rtpo.images_per_attack=1", "logging.report_to=[jsonl]", *extra]


def _train_rows(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


def _adapters(run: Path) -> dict[str, dict]:
    from safetensors.torch import load_file

    return {"policy": load_file(run / "final" / "adapter_model.safetensors"),
            "image_policy": load_file(run / "final_image_policy" / "pytorch_lora_weights.safetensors")}


@pytest.fixture
def models(micro_model: Path, micro_llava: Path, micro_sd3: Path) -> dict[str, Path]:
    return {"lm": micro_model, "llava": micro_llava, "sd3": micro_sd3}


def test_flow_rtpo_trains_both_policies_and_resumes_exactly(models: dict[str, Path], parts: dict[str, Path],
                                                            tmp_path: Path) -> None:
    """One process: both policies' reward terms are logged, each reward is its own weighting of the same scores,
    both adapters move and live in their own checkpoint folders with their own optimizer and learning rate; a run resumed from checkpoint-1 repeats step 2
    of the uninterrupted run (attacks, images' rewards, both losses and gradient norms, both final adapters)."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    lr = "flow_rtpo.image_learning_rate=5e-4"  # the attacker's: training.learning_rate=1e-3
    assert_ok(run_cli(flow_rtpo_args(full, models, parts, 1, "checkpoint.save_steps=1", lr)))
    assert_ok(run_cli(flow_rtpo_args(resumed, models, parts, 1, "checkpoint.save_steps=1", lr,
                                     f"checkpoint.resume_from={full / 'checkpoint-1'}")))
    rows = _train_rows(full)
    assert sorted(rows) == [1, 2]
    last = rows[2]
    for key in ("reward_mean", "toxicity_mean", "cvar_bonus_mean", "quality_mean", "var", "attack_success_rate", "kl",
                "image/reward_mean", "image/cvar_bonus_mean", "image/quality_mean", "image/var", "image/advantage_std",
                "image/kl", "image/ratio", "loss/image_policy", "grad_norm/image_policy"):
        assert key in last, key
    assert last["image/kl"] > 0 and last["grad_norm/image_policy"] > 0 and last["grad_norm"] > 0
    # the attacker's reward and the image policy's: the same toxicity and CVaR bonus, their own quality weights
    attacks = jsonl(full / "attacks.jsonl")
    assert len(attacks) == 8
    for r in attacks:
        assert r["reward"] == pytest.approx(r["toxicity"] + W_CVAR * r["cvar_bonus"] + W_QUALITY_ATTACKER * r["quality"])
        assert r["image_reward"] == pytest.approx(r["toxicity"] + W_CVAR * r["cvar_bonus"] + W_QUALITY_IMAGE * r["quality"])
    for step in (1, 2):
        want = sum(r["image_reward"] for r in attacks if r["step"] == step) / 4
        assert rows[step]["image/reward_mean"] == pytest.approx(want)
    # each role its own folder (optimizer state included); the image policy's holds no LM tokenizer
    import torch

    for role, want in (("policy", 1e-3), ("image_policy", 5e-4)):  # each its own optimizer and learning rate
        groups = torch.load(full / "checkpoint-2" / role / "optimizer.pt", weights_only=False)["optimizer"]["param_groups"]
        assert [g["lr"] for g in groups] == pytest.approx([want] * len(groups)), role
    assert not (full / "checkpoint-2" / "image_policy" / "tokenizer.json").exists()
    a, b = _adapters(full), _adapters(resumed)
    lora_b = [v for k, v in a["image_policy"].items() if "lora_B" in k or "lora.up" in k]
    assert lora_b and max(float(v.abs().max()) for v in lora_b) > 0  # B starts at 0: the image policy trained
    for role in a:
        assert a[role].keys() == b[role].keys()
        assert max((a[role][k] - b[role][k]).abs().max().item() for k in a[role]) <= 1e-6, role
    again = _train_rows(resumed)
    assert sorted(again) == [2]
    for key in ("reward_mean", "image/reward_mean", "toxicity_mean", "loss", "loss/image_policy", "grad_norm",
                "grad_norm/image_policy", "image/kl", "kl"):
        assert again[2][key] == pytest.approx(last[key], rel=1e-4, abs=1e-8), key
    redo = jsonl(resumed / "attacks.jsonl")
    assert [r["attack"] for r in redo] == [r["attack"] for r in attacks if r["step"] == 2]


def test_flow_rtpo_images_per_attack_groups_the_image_policy_by_attack(models: dict[str, Path], parts: dict[str, Path],
                                                                       tmp_path: Path) -> None:
    """``flow_rtpo.images_per_attack=4`` (the reference's num_image_per_prompt) with the image policy's reward
    weights left unset and a text-only quality scorer (the attack's fluency) beside CLIP: every attack is rendered 4 times and each
    image answered and scored (a row each); the image policy's advantages are zero-mean over each attack's 4
    images; the attacker's advantage is its group's over the mean of its images' rewards; the image reward takes
    redteam's tau / w_cvar / w_quality and only the quality the image can change (CLIP, not the attack's fluency)."""
    import torch

    from alignkit.rollout.advantages import group_advantages

    run = tmp_path / "run"
    scorers = (f"redteam.scorers=[{{name: toxicity, model: '{parts['classifier']}'}}, "
               f"{{name: clip_quality, use: quality, model: '{parts['clip']}'}}, "
               f"{{name: fluency, use: quality, text: attack, model: '{models['lm']}'}}]")
    args = [a for a in flow_rtpo_args(run, models, parts, 1, "flow_rtpo.images_per_attack=4", scorers,
                                      "training.max_steps=1", "training.eval_steps=1")
            if not a.startswith("flow_grpo.w_")]  # the image policy's weights: redteam's
    assert_ok(run_cli(args))
    rows = jsonl(run / "attacks.jsonl")
    assert len(rows) == 16 and [r["attack"] for r in rows[::4]] == [r["attack"] for r in rows[3::4]]
    for a in range(4):
        mine = rows[4 * a : 4 * a + 4]
        assert len({r["attack"] for r in mine}) == 1 and len({r["advantage"] for r in mine}) == 1
        assert abs(sum(r["image_advantage"] for r in mine)) < 1e-6  # grouped by attack
        assert len({round(r["image_reward"], 9) for r in mine}) > 1  # 4 different images, 4 rewards
        for r in mine:  # the attacker's per-image reward: every quality; the image policy's: CLIP's alone
            assert r["reward"] == pytest.approx(r["toxicity"] + W_CVAR * r["cvar_bonus"] + W_QUALITY_ATTACKER * r["quality"])
            assert r["image_reward"] == pytest.approx(r["toxicity"] + W_CVAR * r["cvar_bonus"]
                                                      + W_QUALITY_ATTACKER * r["quality/clip_quality"])
            assert r["quality/fluency"] > 0 and r["quality"] == pytest.approx(r["quality/clip_quality"] + r["quality/fluency"])
    means = torch.tensor([sum(r["reward"] for r in rows[i : i + 4]) / 4 for i in range(0, 16, 4)], dtype=torch.float64)
    # per seed prompt (2 attacks), over the attacks' mean rewards, scaled by the batch's std (redteam.scale_rewards)
    want = group_advantages(means, 2, scale_rewards="batch", clip=5.0)
    assert [r["advantage"] for r in rows[::4]] == pytest.approx(want.tolist(), abs=1e-6)
    logged = _train_rows(run)[1]
    assert logged["grad_norm/image_policy"] > 0 and logged["image/reward_mean"] == pytest.approx(
        sum(r["image_reward"] for r in rows) / 16)
    assert (run / "final_image_policy" / "pytorch_lora_weights.safetensors").exists()


@pytest.mark.slow(seconds=150)  # 210 s measured at a load average of 8-12 (the whole file: 307 s)
@pytest.mark.distributed
def test_flow_rtpo_under_accelerate_one_node_and_two_node_loopback_equal_one_process(
        models: dict[str, Path], parts: dict[str, Path], tmp_path: Path) -> None:
    """The guide's launch forms through ``alignkit launch --launcher accelerate``: 2 processes on one node, and two
    "machines" of one process on this one (``--num_machines 2 --machine_rank R --main_process_ip 127.0.0.1``).
    With greedy attacks and 2 images per attack (each image's noise is seeded by its global index, each rank
    renders the images of its own attacks) both equal ONE process: the same attacks, VLM answers and rewards of
    both policies (placement main: rank 0 scores every rank's samples, each
    rank trains on its own), the same losses and gradient norms of both policies (each role normalised by its own
    global unit count) and the same two trained adapters."""
    import subprocess

    from tests.conftest import child_env, free_port, run_nodes

    # greedy: a seed's attacks are one text, so per-seed statistics would leave the attacker a zero gradient (its
    # advantages cancel) that Adam turns into noise-sized steps; global statistics keep a real one
    greedy, stats, no_eval = "rollout.temperature=0", "redteam.statistics=global", "data.eval=[]"  # eval: the other test's
    two_images = "flow_rtpo.images_per_attack=2"  # each rank renders its attacks' images: their global indices
    launch = [sys.executable, "-m", "alignkit", "launch", "--launcher", "accelerate"]
    single, one, two, port = tmp_path / "single", tmp_path / "one_node", tmp_path / "two_nodes", str(free_port())
    assert_ok(run_cli(flow_rtpo_args(single, models, parts, 1, greedy, stats, no_eval, two_images)))
    assert_ok(subprocess.run([*launch, "--nproc-per-node", "2", "--master-port", str(free_port()),
                              *flow_rtpo_args(one, models, parts, 2, greedy, stats, no_eval, two_images)[1:]],
                             check=False, capture_output=True, text=True, timeout=400, cwd=REPO, env=child_env()))
    run_nodes([[*launch, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(r), "--master-addr", "127.0.0.1",
                "--master-port", port, *flow_rtpo_args(two, models, parts, 2, greedy, stats, no_eval, two_images)[1:]]
               for r in (0, 1)],
              timeout=400, cwd=REPO)
    rows = {run.name: jsonl(run / "attacks.jsonl") for run in (single, one, two)}
    assert len(rows["single"]) == 16  # 2 iterations x 4 attacks x 2 images
    for name in ("one_node", "two_nodes"):
        for key in ("attack", "output"):
            assert [r[key] for r in rows[name]] == [r[key] for r in rows["single"]], (name, key)
        for key in ("reward", "image_reward"):
            assert [r[key] for r in rows[name]] == pytest.approx([r[key] for r in rows["single"]], abs=1e-5), (name, key)
        # the first iteration (before any update) agrees to 1e-5. After one update whose gradients were summed in
        # another order (adapters <= 1e-5 apart, below), one of the 8 image rewards differs by 8.6e-6, its attack's
        # reward by 2.5e-6; the attacker's advantages (global statistics: over 4 attack rewards that lie within 0.033,
        # std 0.016) divide that by the std, so they move up to 3.9e-5 (all 8 rows: the mean and std move too).
        # The same reward differences at 6713f74 (before the merges), ca47f96, 76da72b and a91c020 (advantages 3.9e-5
        # there, 3.7e-5 at a91c020, whose attack texts h3's whole-sequence decoding changed): reduction order
        # amplified by 1/std, no merge's doing; the bound is the reward's 1e-5 over that std's order (1e-2): 1e-4.
        for key in ("advantage", "image_advantage"):
            first, second = rows["single"][:8], rows["single"][8:]
            assert [r[key] for r in rows[name][:8]] == pytest.approx([r[key] for r in first], abs=1e-5), (name, key)
            assert [r[key] for r in rows[name][8:]] == pytest.approx([r[key] for r in second], abs=1e-4), (name, key)
    logged = {run.name: _train_rows(run) for run in (single, one, two)}
    for name in ("one_node", "two_nodes"):
        assert sorted(logged[name]) == [1, 2]
        for step in (1, 2):
            for key in ("reward_mean", "image/reward_mean", "loss", "loss/image_policy", "grad_norm",
                        "grad_norm/image_policy", "kl", "image/kl"):
                a, b = logged["single"][step][key], logged[name][step][key]
                assert b == pytest.approx(a, rel=1e-3, abs=1e-7), (name, step, key, a, b)
    base = _adapters(single)
    for run in (one, two):
        got = _adapters(run)
        for role in base:
            assert max((base[role][k] - got[role][k]).abs().max().item() for k in base[role]) <= 1e-5, (run.name, role)
