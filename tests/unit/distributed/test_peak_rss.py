"""The peak-RSS child (peak_rss.py) reports its own peak, not the peak of the process that started it: the
cause of the CPU cast check's 435 MB (357 MB alone) inside a full xdist run."""

from __future__ import annotations

import resource

from tests.unit.distributed.peak_rss import measure, measure_env

_REPORT = ("import json, resource\n"
           "print(json.dumps({'vmhwm': peak_bytes(), 'maxrss': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))")


def test_child_peak_is_its_own_not_the_parents() -> None:
    """ru_maxrss survives exec (Linux): a bare child reads at least this pytest process's peak (torch and the
    test modules imported: hundreds of MB); VmHWM reads the child's own few tens of MB."""
    grown = bytearray(200 * 2**20)  # this process's peak now exceeds 200 MB, whatever ran before
    del grown
    parent_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    m = measure(_REPORT, threads=1, timeout=60)
    assert m["maxrss"] >= parent_peak  # the inherited high-water mark: what the old measurement read
    assert m["vmhwm"] < 100 * 2**20 < parent_peak


def test_child_environment_is_built_not_inherited(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/nowhere")
    env = measure_env(threads=2)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "2"
    assert env["MALLOC_MMAP_THRESHOLD_"] == "131072"
    assert "MALLOC_ARENA_MAX" not in env and "TORCHINDUCTOR_CACHE_DIR" not in env
