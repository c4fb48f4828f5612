"""``alignkit.launch.deepspeed_runner``: DeepSpeed's runner starts its ``launch`` child armed with the parent-death
signal (issue 50.15 for ``--launcher deepspeed``); the 2-worker kill test is in tests/distributed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from alignkit.launch import deepspeed_runner


def test_the_runners_popen_arms_its_child_and_the_rest_of_subprocess_is_unchanged(monkeypatch) -> None:
    seen = {}
    monkeypatch.setattr(deepspeed_runner, "preexec", lambda: seen.setdefault("fn", lambda: None))
    proc = deepspeed_runner.ArmedPopen([sys.executable, "-c", "pass"])
    assert proc.wait() == 0 and "fn" in seen
    shim = deepspeed_runner.ArmedSubprocess()
    assert shim.Popen is deepspeed_runner.ArmedPopen
    assert shim.check_output is subprocess.check_output and shim.PIPE == subprocess.PIPE


def test_main_runs_deepspeeds_runner_with_the_armed_module(monkeypatch) -> None:
    runner = pytest.importorskip("deepspeed.launcher.runner")
    called = {}
    monkeypatch.setattr(runner, "main", lambda args: called.update(args=args, sub=runner.subprocess))
    monkeypatch.setattr(runner, "subprocess", subprocess)  # restored after the test
    deepspeed_runner.main(["--num_gpus=2", "x.py"])
    assert called["args"] == ["--num_gpus=2", "x.py"]
    assert isinstance(called["sub"], deepspeed_runner.ArmedSubprocess)
