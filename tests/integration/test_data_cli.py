"""``alignkit prepare CONFIG`` and ``scripts/prepare_datasets.py --config CONFIG`` fill the data cache; a
training run afterwards prepares nothing (it memory-maps what they wrote)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, assert_ok, child_env, run_cli, write_config


@pytest.mark.slow  # three CLI processes: ~45 s on 2 shared cores
def test_prepare_fills_the_cache_then_train_hits_it(sft_config: dict, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    sft_config["data"].update({"eval": "builtin:sft_eval.jsonl", "max_eval_examples": 8, "cache_dir": str(cache)})
    cfg = write_config(tmp_path / "sft.yaml", sft_config)
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "prepare_datasets.py"), "--config", str(cfg),
                           "--num_proc", "2"], capture_output=True, text=True, timeout=300, env=child_env())
    assert_ok(proc)
    assert "train: 64 examples from builtin:sft_train.jsonl" in proc.stdout
    assert "eval: 8 examples from builtin:sft_eval.jsonl" in proc.stdout
    assert f"cache: {cache} (data.num_proc=2)" in proc.stdout
    folders = sorted(p.name for p in cache.iterdir())
    assert len(folders) == 2 and all((cache / f / "manifest.json").is_file() for f in folders)
    train = run_cli(["train", str(cfg), "training.max_steps=1"])
    assert_ok(train)
    assert "Prepared" not in train.stderr and train.stderr.count("Data cache hit") == 2
    assert sorted(p.name for p in cache.iterdir()) == folders
