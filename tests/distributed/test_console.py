"""Under 2 processes rank 0 alone speaks: the config's alias notes once, no library warning per rank
(DDP's deprecated ``broadcast_buffers``, transformers' progress bars)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import assert_ok, run_cli, write_config
from tests.integration.test_quiet_console import assert_quiet

pytestmark = pytest.mark.distributed


def test_ddp_run_log_is_rank_zero_only(micro_model: Path, tmp_path: Path) -> None:
    cfg = {  # HF-style keys, so the notes show
        "algorithm": "sft", "output_dir": str(tmp_path / "run"), "model_name_or_path": str(micro_model),
        "per_device_train_batch_size": 2, "max_steps": 2, "distributed_strategy": "ddp",
        "data": {"train": "builtin:sft_train.jsonl", "max_length": 64, "max_train_examples": 16},
        "logging": {"logging_steps": 1, "report_to": ["console"]},
    }
    proc = run_cli(["train", str(write_config(tmp_path / "c.yaml", cfg))], nproc=2)
    assert_ok(proc)
    assert_quiet(proc.stdout + proc.stderr)
    assert proc.stderr.count("config: per_device_train_batch_size=2 read as training.per_device_batch_size=2") == 1
    assert proc.stderr.count("Saved final model") == 1
