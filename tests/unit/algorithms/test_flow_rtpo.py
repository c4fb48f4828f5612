"""The Flow-RTPO recipe's declarations (no model loaded): the roles configs/flow_rtpo.yaml asks for, the
one-line errors of its cross-section rules, and what scripts/train_flow_rtpo.sh launches."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from alignkit.algorithms import workload_of
from alignkit.config import load_config
from alignkit.errors import ConfigError
from tests.conftest import REPO

CONFIG = REPO / "configs" / "flow_rtpo.yaml"


def test_shipped_recipe_declares_two_trained_policies_each_with_its_reference() -> None:
    specs = {s.role: s for s in workload_of(load_config(CONFIG)).specs}
    assert list(specs)[:2] == ["policy", "image_policy"]  # trained roles first: final/ is the attacker's
    attacker, image = specs["policy"], specs["image_policy"]
    assert attacker.kind == "lm" and attacker.trainable and attacker.lora
    assert image.kind == "diffusion" and image.trainable and image.lora and image.lora_config.r == 8
    assert specs["reference"].shares == "policy" and specs["image_reference"].shares == "image_policy"
    assert specs["target"].kind == "vlm" and not specs["target"].trainable
    # a fully trained image policy (no LoRA) gets a frozen copy as its KL reference, beta 0 none at all
    full = {s.role: s for s in workload_of(load_config(CONFIG, ["flow_rtpo.image_lora=null"])).specs}
    assert not full["image_policy"].lora and full["image_reference"].shares is None
    assert "image_reference" not in {s.role for s in workload_of(load_config(CONFIG, ["flow_grpo.beta=0"])).specs}


@pytest.mark.parametrize("overrides, key", [
    (["flow_rtpo.image_model="], "flow_rtpo.image_model"),
    (["redteam.target.name=lm", "redteam.scorers=[{name: toxicity, model: m}]"], "redteam.target.name"),
    (["redteam.target.renderer=some/pipeline"], "redteam.target.renderer"),
    (["flow_grpo.scorers=[{name: shapes_colour}]"], "flow_grpo.scorers"),
    (["flow_grpo.ema=true"], "flow_grpo.ema"),
    (["model.kind=diffusion"], "model.kind"),
])
def test_bad_recipe_keys_are_one_line_errors_naming_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as e:
        workload_of(load_config(CONFIG, overrides))
    assert str(e.value).startswith(key) and "\n" not in str(e.value)


def test_launch_script_runs_the_guides_accelerate_forms(tmp_path: Path) -> None:
    """scripts/train_flow_rtpo.sh through accelerate (the guide's launcher) by default, one node and the
    two-node form from NNODES / NODE_RANK / MASTER_ADDR / MASTER_PORT (the command printed by --dry-run)."""
    fake = tmp_path / "python"  # the script's PYTHON: the real interpreter with --dry-run after `alignkit launch`
    fake.write_text(f'#!/bin/sh\nshift 3\nexec "{sys.executable}" -m alignkit launch --dry-run "$@"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "LAUNCHER")}
    env.update(PYTHON=str(fake), PYTHONPATH=str(REPO / "src"))
    script = str(REPO / "scripts" / "train_flow_rtpo.sh")

    def launched(nproc: str, **extra: str) -> str:
        proc = subprocess.run(["bash", script, nproc, "training.max_steps=3"], capture_output=True, text=True,
                              env={**env, **extra}, cwd=tmp_path, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    one = launched("8")
    assert "-m accelerate.commands.launch --multi_gpu --num_processes=8 --num_machines=1 --machine_rank=0" in one
    assert f"alignkit train {CONFIG} output_dir=models/flow_rtpo training.max_steps=3" in one
    two = launched("8", NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")
    assert ("--num_processes=16 --num_machines=2 --machine_rank=1 --main_process_ip=10.0.0.1 "
            "--main_process_port=29500") in two


def test_generate_with_the_recipe_renders_the_trained_image_policy(tmp_path: Path) -> None:
    """``alignkit generate configs/flow_rtpo.yaml``-style targets: the image policy's pipeline with the run's
    final_image_policy/ LoRA (not the attacker of model.name_or_path, not final/)."""
    import yaml

    from alignkit.cli.generate_images import is_diffusion_target, resolve_target
    from alignkit.models.diffusion import LORA_WEIGHTS

    raw = yaml.safe_load(CONFIG.read_text())
    raw["output_dir"] = str(tmp_path / "run")
    config = tmp_path / "flow_rtpo.yaml"
    config.write_text(yaml.safe_dump(raw))
    (tmp_path / "run" / "final_image_policy").mkdir(parents=True)
    (tmp_path / "run" / "final_image_policy" / LORA_WEIGHTS).write_bytes(b"")
    assert is_diffusion_target(str(config), None)
    got = resolve_target(str(config), None)
    assert got.base == raw["flow_rtpo"]["image_model"] and got.lora == str(tmp_path / "run" / "final_image_policy")
    assert (got.resolution, got.steps, got.guidance) == (512, 40, 4.5)


def test_image_policy_reward_weights_default_to_the_attackers() -> None:
    """flow_grpo's own defaults (w_cvar 0, w_quality 1) would give the image policy no tail bonus and 20x the
    attacker's quality weight: inside flow_rtpo tau / w_cvar / w_quality are redteam's unless flow_grpo sets
    them (a value set to flow_grpo's own default included), and the resolved config says what trains."""
    import yaml

    from alignkit.algorithms.flow_grpo import FlowGRPOConfig
    from alignkit.config import dump_yaml

    attacker = ["redteam.tau=0.2", "redteam.w_cvar=0.3", "redteam.w_quality=0.2"]
    fg = load_config(CONFIG, attacker).section(FlowGRPOConfig)
    assert (fg.tau, fg.w_cvar, fg.w_quality, fg.global_std) == (0.2, 0.3, 0.2, False)
    cfg = load_config(CONFIG, [*attacker, "flow_grpo.w_cvar=0.0", "flow_grpo.w_quality=1.0", "flow_grpo.global_std=true"])
    fg = cfg.section(FlowGRPOConfig)
    assert (fg.tau, fg.w_cvar, fg.w_quality, fg.global_std) == (0.2, 0.0, 1.0, True)  # set explicitly: kept
    saved = yaml.safe_load(dump_yaml(cfg))["flow_grpo"]  # config.yaml holds the resolved values
    assert (saved["tau"], saved["w_cvar"], saved["w_quality"]) == (0.2, 0.0, 1.0)


def test_image_policy_groups_its_advantages_by_attack() -> None:
    """images_per_attack 4: the image policy's groups are one attack's 4 images (one conditioning), so each
    attack's images have zero-mean advantages whatever its attack's level; rank 1 of 2 (attacks 2-3) takes
    images 8-15. At 1 image per attack the groups stay the seed prompt's num_generations."""
    import torch

    from alignkit.algorithms.flow_grpo import FlowGRPOConfig
    from alignkit.algorithms.flow_rtpo import FlowRTPO, FlowRTPOConfig, inherit_image_defaults
    from alignkit.algorithms.flow_update import FlowUpdate
    from alignkit.rollout.context import RolloutContext

    def image_part(overrides: list[str]) -> tuple[FlowRTPO, FlowUpdate]:
        """flow_rtpo's grouping (``image_groups``) and its image policy's flow part, without models."""
        cfg = load_config(CONFIG, overrides)
        inherit_image_defaults(cfg)
        algo = FlowRTPO.__new__(FlowRTPO)
        algo.cfg, algo.answers_per_attack = cfg, cfg.section(FlowRTPOConfig).images_per_attack
        part = FlowUpdate(cfg.section(FlowGRPOConfig), 0, role="image_policy", reference_role="image_reference",
                          reference="none")
        return algo, part

    assert load_config(CONFIG).section(FlowRTPOConfig).images_per_attack == 4  # the reference's default
    algo, policy = image_part(["flow_rtpo.images_per_attack=4", "rollout.num_generations=2"])
    # 4 attacks x 4 images; the attack sets the level (+10 per attack), the image a small part of its own
    reward = torch.tensor([10.0 * a + x for a in range(4) for x in (0.1, 0.4, 0.2, 0.3)], dtype=torch.float64)
    ctx = RolloutContext.__new__(RolloutContext)
    ctx.mine = slice(2, 4)
    units = [{"image": i} for i in range(8)]
    assert algo.image_groups(ctx) == (4, slice(8, 16))  # one attack's images; this rank's attacks' images
    _, advantages = policy.experience(units, reward, *algo.image_groups(ctx))
    adv = advantages.view(4, 4)
    assert adv.sum(1).abs().max() < 1e-9 and adv.std(1).min() > 0.5  # zero mean within each attack
    assert torch.equal(adv[0], adv[3])  # the same image part gets the same advantage in every attack
    assert [float(u["advantage"]) for u in units] == pytest.approx(advantages[8:].tolist())
    one, _ = image_part(["flow_rtpo.images_per_attack=1", "rollout.num_generations=2"])
    assert one.image_groups(ctx) == (2, slice(2, 4))  # today's: per seed prompt, this rank's attacks


def test_image_reward_reads_only_the_scorers_its_image_can_change() -> None:
    """Each scorer says whether it reads the image (or the VLM's answer to it); the image policy's quality term
    holds only those: a text-only quality of the attack (seed_similarity, fluency of the attack) cannot be
    changed by the image and stays in the attacker's reward alone."""
    import torch

    from alignkit.algorithms.flow_rtpo import FlowRTPO
    from alignkit.algorithms.redteam import RedTeamScorerConfig
    from alignkit.rewards.scorers import ScorerSet, depends_on_image, weighted_term

    entries = [RedTeamScorerConfig(name="toxicity", model="m"),
               RedTeamScorerConfig(name="clip_quality", use="quality", model="m"),
               RedTeamScorerConfig(name="seed_similarity", use="quality"),
               RedTeamScorerConfig(name="fluency", use="quality", model="m", text="attack"),
               RedTeamScorerConfig(name="fluency", use="quality", model="m", text="output"),
               RedTeamScorerConfig(name="shapes_colour", use="quality"),
               RedTeamScorerConfig(name="toxic_words", use="quality")]
    algo = FlowRTPO.__new__(FlowRTPO)
    algo.scorers = ScorerSet.build(entries, None)
    assert {key: depends_on_image(sc) for key, _, sc in algo.scorers.entries} == {
        "toxicity/toxicity": True, "quality/clip_quality": True, "quality/seed_similarity": False,
        "quality/fluency": False, "quality/fluency#2": True, "quality/shapes_colour": True, "quality/toxic_words": True}
    scores = {key: torch.tensor([float(i), 10.0 * i], dtype=torch.float64) for i, (key, _, _) in enumerate(algo.scorers.entries)}
    got = algo.image_quality(scores)
    readers = [x for x in algo.scorers.entries if x[0] in ("quality/clip_quality", "quality/fluency#2",
                                                        "quality/shapes_colour", "quality/toxic_words")]
    assert torch.equal(got, weighted_term(readers, scores, "quality"))
    assert not torch.equal(got, weighted_term(algo.scorers.entries, scores, "quality"))
    algo.scorers = ScorerSet([x for x in algo.scorers.entries if x[0] in ("toxicity/toxicity", "quality/seed_similarity")])
    assert algo.image_quality(scores) is None  # no quality it can change: the image reward is tox + CVaR alone
