"""Data preparation under a launcher: rank 0 tokenises, the other ranks wait and memory-map the cache."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import assert_ok, run_script

WORKERS = Path(__file__).parent / "workers"


def test_rank1_never_tokenises(micro_model: Path, tmp_path: Path) -> None:
    proc = run_script(WORKERS / "prepare_once.py", nproc=2, args=[str(micro_model), str(tmp_path / "cache")])
    assert_ok(proc)
    assert "rank 1 never tokenised" in proc.stdout
