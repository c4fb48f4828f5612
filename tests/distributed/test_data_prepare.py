"""Data preparation under a launcher: rank 0 tokenises, the other ranks wait and memory-map the cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import assert_ok, run_script, write_config

pytestmark = pytest.mark.distributed

WORKERS = Path(__file__).parent / "workers"


def test_rank1_never_tokenises(micro_model: Path, tmp_path: Path) -> None:
    proc = run_script(WORKERS / "prepare_once.py", nproc=2, args=[str(micro_model), str(tmp_path / "cache")])
    assert_ok(proc)
    assert "rank 1 never tokenised" in proc.stdout


def test_without_a_shared_file_system_each_node_prepares(micro_model: Path, tmp_path: Path) -> None:
    proc = run_script(WORKERS / "prepare_once.py", nproc=2,
                      args=[str(micro_model), str(tmp_path / "cache"), "two-nodes"])
    assert_ok(proc)
    assert "each node prepared its own copy" in proc.stdout


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_streamed_run_on_two_ranks_resumes_exactly(sft_config: dict, tmp_path: Path) -> None:
    """Two ranks share a stream's rows; a run resumed from checkpoint-3 on two ranks repeats steps 4-6
    of the uninterrupted run (each rank seeks to its own saved position)."""
    rows = [{"prompt": f"Say {i}.", "completion": f"{i} {i}."} for i in range(37)]
    data = tmp_path / "s.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    cfg = dict(sft_config)
    cfg["data"] = {"train": str(data), "streaming": True, "max_length": 24}
    cfg["training"] = {**cfg["training"], "per_device_batch_size": 3, "max_steps": 6}
    cfg["checkpoint"] = {"save_final": False, "save_steps": 3}
    cfg["output_dir"] = str(tmp_path / "a")
    a = write_config(tmp_path / "a.yaml", cfg)
    # the resumed run into a fresh folder, from a's checkpoint-3: both runs in one torchrun launch
    # (workers/train_many.py runs them one after the other)
    cfg["output_dir"] = str(tmp_path / "b")
    cfg["checkpoint"] = {**cfg["checkpoint"], "resume_from": str(tmp_path / "a" / "checkpoint-3")}
    b = write_config(tmp_path / "b.yaml", cfg)
    assert_ok(run_script(WORKERS / "train_many.py", nproc=2, args=[str(a), str(b)], timeout=400))
    saved = json.loads((tmp_path / "a" / "checkpoint-3" / "trainer_state.json").read_text())["stream"]
    assert [p["row"] for p in saved] == [17, 18]  # 9 rows each: rank 0 last read row 16, rank 1 row 17
    full, resumed = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert len(full) == 6 and resumed == pytest.approx(full[3:], rel=1e-6, abs=1e-7)
