"""What a newcomer meets at the command line: ``--help`` names every command, ``validate`` prints the config
sections that apply to the run, ``tiny-model`` refuses a folder that holds files, the tiny SD3's VAE fit shows its
progress."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import pytest

from alignkit import progress
from alignkit.cli import build_parser, main
from tests.conftest import write_config


def registered_commands() -> list[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


def test_help_summary_names_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    summary = " ".join(out.split("\n\n")[1].split())  # the description paragraph, unwrapped
    assert summary.startswith("The alignkit command: ")
    listed = {name.split()[0] for name in summary.removeprefix("The alignkit command: ").rstrip(".").split(" | ")}
    assert listed == set(registered_commands())
    assert {"prepare", "vllm-serve", "generate"} <= listed and "data synth" in summary


def validate_sections(cfg: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[set[str], str]:
    """The top-level keys of ``alignkit validate``'s resolved config, and its comment line on what it left out."""
    import yaml

    assert main(["validate", str(write_config(tmp_path / "c.yaml", cfg))]) == 0
    out = capsys.readouterr().out
    resolved = out.split("# resolved config\n", 1)[1].split("# plan", 1)[0]
    return set(yaml.safe_load(resolved)), next(line for line in resolved.splitlines() if line.startswith("# other"))


def test_validate_prints_the_sections_that_apply(sft_config: dict[str, Any], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import alignkit.algorithms  # noqa: F401  (registers the sections)
    from alignkit.config.schema import RunConfig
    from alignkit.config.sections import registered_sections

    core = {f for f in RunConfig.__dataclass_fields__ if f != "sections"}
    keys, note = validate_sections(sft_config, tmp_path, capsys)
    assert keys == core | {"sft"}, keys
    assert "dpo" in note and "rollout" in note and "sft" not in note.split(": ", 1)[1].split(", ")
    # a section the config sets shows although another algorithm's; an online algorithm shows its own
    keys, _ = validate_sections({**sft_config, "dpo": {"beta": 0.3}}, tmp_path, capsys)
    assert keys == core | {"sft", "dpo"}
    grpo = {**sft_config, "algorithm": "grpo", "data": {**sft_config["data"], "train": "builtin:digits_prompts_train.jsonl"},
            "training": {**sft_config["training"], "per_device_batch_size": 8}}
    keys, _ = validate_sections(grpo, tmp_path, capsys)
    assert {"grpo", "rollout", "reward"} <= keys and not keys & {"dpo", "sft", "ppo"}
    assert set(registered_sections()) - keys  # the others are left out


def test_tiny_model_refuses_a_folder_that_holds_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["tiny-model", str(out), "--size", "micro"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is not empty (it holds notes.txt)" in err and "--overwrite" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # nothing written
    assert main(["tiny-model", str(out), "--size", "micro", "--overwrite"]) == 0
    assert (out / "config.json").is_file() and (out / "notes.txt").read_text() == "mine"
    capsys.readouterr()
    # the same command again (a page followed twice): the folder already holds that model, kept as it is
    weights = (out / "model.safetensors").stat().st_mtime_ns
    assert main(["tiny-model", str(out), "--size", "micro"]) == 0
    assert "already holds this tiny model" in capsys.readouterr().out
    assert (out / "model.safetensors").stat().st_mtime_ns == weights
    assert main(["tiny-model", str(out), "--size", "micro", "--seed", "1"]) == 2  # another model: refused


def test_plot_of_several_runs_writes_beside_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not into the working directory (a clone's root, when a page is followed there)."""
    for name in ("a", "b"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.0}\n')
    monkeypatch.chdir(tmp_path)
    assert main(["plot", "runs/a", "runs/b"]) == 0
    assert (tmp_path / "runs" / "plots.png").is_file() and not (tmp_path / "plots.png").exists()


def test_vae_fit_shows_steps_and_an_estimate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    """Off a terminal the fit logs its step count, rate and ETA (on a terminal: a tqdm bar of the same)."""
    pytest.importorskip("diffusers")
    from alignkit.models.tiny_sd3 import fit_vae, tiny_vae

    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)  # a line every step, not every 30 s
    monkeypatch.setattr(progress, "use_bar", lambda: False)
    progress.configure(is_main=True, mode="auto")
    logger = logging.getLogger("alignkit")
    logger.addHandler(caplog.handler)  # the CLI's console handler does not propagate
    caplog.set_level(logging.INFO, logger="alignkit")
    try:
        fit_vae(tiny_vae(), steps=3, batch=2)
    finally:
        logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fitting the VAE")]
    assert lines[0].startswith("fitting the VAE to the shapes scenes: 1/3 (33%)") and "ETA" in lines[0], lines
    assert lines[-1].startswith("fitting the VAE to the shapes scenes: 3/3")
