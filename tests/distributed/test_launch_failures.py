"""``alignkit launch`` when things go wrong (issue 50): a worker's one-line error is the run's one line and exit
status (50.8), and a SIGKILL to the launcher's process group takes the workers with it (50.15). 2 gloo processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import REPO, child_env, free_port, write_config

pytestmark = pytest.mark.distributed


def _config(tmp_path: Path, micro_model: Path, **data: object) -> Path:
    return write_config(tmp_path / "sft.yaml", {
        "algorithm": "sft", "output_dir": str(tmp_path / "run"), "model": {"name_or_path": str(micro_model)},
        "data": {"train": "builtin:sft_train.jsonl", "max_length": 64, "max_train_examples": 40, **data},
        "training": {"per_device_batch_size": 2, "learning_rate": 1e-3, "max_steps": 100000, "seed": 0},
        "logging": {"logging_steps": 1, "report_to": ["jsonl"]},
    })


def _launch(config: Path) -> list[str]:
    return [sys.executable, "-m", "alignkit", "launch", "--nproc-per-node", "2", "--master-port", str(free_port()),
            str(config)]


@pytest.mark.slow(seconds=40)
def test_a_workers_one_line_error_is_the_runs_line_and_status(micro_model: Path, tmp_path: Path) -> None:
    """Before: the worker's line, then ~90 lines of torchrun (SIGTERM notices, a ChildFailedError traceback, a block
    per rank) and exit 1. Now: the line once, exit 2. ~40 s on 2 idle cores (75 s at load 15)."""
    config = _config(tmp_path, micro_model, train=str(tmp_path / "missing.jsonl"))
    proc = subprocess.run(_launch(config), capture_output=True, text=True, timeout=300, env=child_env(), cwd=REPO,
                          check=False)
    errors = [x for x in proc.stderr.splitlines() if "alignkit: error: " in x]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert errors == [f"alignkit: error: data file '{tmp_path / 'missing.jsonl'}' does not exist"], proc.stderr
    for noise in ("ChildFailedError", "Traceback", "alignkit FAILED", "closing signal SIGTERM"):
        assert noise not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.rstrip().endswith(errors[0])  # nothing after it


def _tagged(tag: str) -> list[int]:
    """The processes whose environment holds ``ALIGNKIT_TEST_TAG=tag``: the launcher, torchrun and the workers."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f"ALIGNKIT_TEST_TAG={tag}".encode() in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def _left_after(tag: str, seconds: float) -> list[int]:
    """The tagged processes still alive after waiting up to ``seconds`` for them to go."""
    deadline = time.monotonic() + seconds
    while _tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    return _tagged(tag)


def _kill_all(tag: str) -> None:
    """Never leave a trainer behind, whatever failed."""
    for pid in _tagged(tag):
        os.kill(pid, signal.SIGKILL)


@pytest.mark.slow(seconds=30)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_sigkill_to_the_launchers_group_leaves_no_worker(micro_model: Path, tmp_path: Path) -> None:
    """torchrun starts its workers in sessions of their own: before, they trained on after `kill -9 -PGID` of
    `alignkit launch` (the old code: 2 workers still alive 15 s later); now every one is gone within seconds
    (measured: 1.1 s on 2 busy cores). The test takes ~35 s on 2 idle cores (80 s at load 15)."""
    tag, log = uuid.uuid4().hex, tmp_path / "launch.log"
    with log.open("w") as err:
        proc = subprocess.Popen(_launch(_config(tmp_path, micro_model)), stdout=subprocess.DEVNULL, stderr=err,
                                env=child_env(ALIGNKIT_TEST_TAG=tag), cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while "Pre-flight OK" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(1.0)  # both workers are up (and armed) and on their way to training
        assert proc.poll() is None, log.read_text()[-3000:]
        assert len(_tagged(tag)) >= 4, (_tagged(tag), log.read_text()[-3000:])  # launcher, torchrun, 2 workers
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert _left_after(tag, 10) == [], "workers outlived their launcher"
    finally:
        _kill_all(tag)


@pytest.mark.slow(seconds=20)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_sigkill_to_the_launcher_takes_deepspeeds_launch_and_its_workers(tmp_path: Path) -> None:
    """``--launcher deepspeed``: alignkit launch -> DeepSpeed's runner -> ``deepspeed.launcher.launch`` -> workers.
    The runner is armed by ``supervise`` but on one node neither arms ``launch`` nor stops it on SIGTERM: before,
    with ``-m deepspeed.launcher.runner``, a SIGKILL to ``alignkit launch`` alone left ``launch`` and both workers
    running (measured: 3 processes alive 15 s later). Through ``alignkit.launch.deepspeed_runner`` ``launch`` gets
    SIGTERM when the runner dies, and its handler ends the workers (plain sleepers here, not armed themselves).
    ~15 s on 2 idle cores (two deepspeed imports)."""
    pytest.importorskip("deepspeed")
    from alignkit.launch.torchrun import launcher_argv

    tag, log, script = uuid.uuid4().hex, tmp_path / "launch.log", tmp_path / "worker.py"
    script.write_text("import time\ntime.sleep(300)\n")
    argv = launcher_argv("deepspeed", sys.executable, nproc=2, nnodes=1, node_rank="0", master_addr="127.0.0.1",
                         master_port=str(free_port()), train=[])
    argv[argv.index("--module")] = str(script)  # the workers: `python worker.py` instead of `python -m alignkit ...`
    supervisor = f"import sys; from alignkit.launch.run import supervise; sys.exit(supervise({argv!r}, dict(__import__('os').environ)))"
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-c", supervisor], stdout=subprocess.DEVNULL, stderr=err,
                                env=child_env(ALIGNKIT_TEST_TAG=tag), cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(_tagged(tag)) < 5 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(_tagged(tag)) == 5, (_tagged(tag), log.read_text()[-3000:])  # alignkit, runner, launch, 2 workers
        os.kill(proc.pid, signal.SIGKILL)  # alignkit launch alone (its group would take everyone: no setsid here)
        proc.wait()
        assert _left_after(tag, 15) == [], "deepspeed's launch or its workers outlived alignkit launch"
    finally:
        _kill_all(tag)
