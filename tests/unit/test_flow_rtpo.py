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
