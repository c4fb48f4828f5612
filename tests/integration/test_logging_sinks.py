"""W&B offline logging works without a network and never records a secret."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import assert_ok, child_env, run_cli, write_config


def test_wandb_offline_and_no_secret_logged(sft_config: dict[str, Any], tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    secret = "wandb-secret-key-0123456789"
    cfg = dict(sft_config, output_dir=str(tmp_path / "run"))
    cfg["logging"] = {"logging_steps": 1, "report_to": ["console", "jsonl", "wandb"], "run_name": "t"}
    cfg["training"] = dict(cfg["training"], max_steps=2)
    env = child_env(WANDB_MODE="offline", WANDB_API_KEY=secret, WANDB_SILENT="true")
    proc = run_cli(["train", str(write_config(tmp_path / "c.yaml", cfg))], env=env)
    assert_ok(proc)
    run_dirs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert run_dirs, "W&B offline run directory missing"
    assert list(run_dirs[0].glob("*.wandb"))
    for f in (tmp_path / "run").rglob("*"):
        if f.is_file():
            assert secret.encode() not in f.read_bytes(), f"secret leaked into {f}"
    assert secret not in proc.stdout + proc.stderr
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def test_scrub_hides_secret_like_keys() -> None:
    from alignkit.logging import scrub

    out = scrub({"logging": {"wandb_api_key": "abc", "hf_token": "x", "run_name": "ok"}, "lr": 1})
    assert out == {"logging": {"wandb_api_key": "***", "hf_token": "***", "run_name": "ok"}, "lr": 1}
    keep = {"rollout": {"max_new_tokens": 8, "max_prompt_tokens": 64}, "model": {"tokenizer": "tok"},
            "logging": {"console_keys": ["loss"], "token": "t", "client_secret": "s", "password": "p", "secret_key": "k"}}
    assert scrub(keep) == {"rollout": {"max_new_tokens": 8, "max_prompt_tokens": 64}, "model": {"tokenizer": "tok"},
                           "logging": {"console_keys": ["loss"], "token": "***", "client_secret": "***",
                                       "password": "***", "secret_key": "***"}}


@pytest.mark.parametrize("name", ["grpo.yaml", "redteam.yaml", "flow_rtpo.yaml", "safe_dpo.yaml"])
def test_the_config_a_run_writes_loads_again(name: str, tmp_path: Path) -> None:
    """OUTPUT_DIR/config.yaml (scrubbed) is a config alignkit reads back to the same settings."""
    import yaml

    from alignkit.config import load_config
    from alignkit.config.loader import to_dict
    from alignkit.logging import scrub
    from tests.conftest import REPO

    cfg = to_dict(load_config(REPO / "configs" / name))
    written = tmp_path / "config.yaml"
    written.write_text(yaml.safe_dump(scrub(cfg), sort_keys=False), encoding="utf-8")
    assert to_dict(load_config(written)) == cfg
