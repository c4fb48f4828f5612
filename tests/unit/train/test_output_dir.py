"""What counts as another run in an output_dir (issue 42.1): logged steps, checkpoints, latest, a final or
epoch model; a folder a run left before its first logged step is free again."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from alignkit.config import RunConfig, load_config
from alignkit.errors import ConfigError
from alignkit.train.output_dir import aside_path, check_reuse, run_algorithm, run_marks


def config(out: Path, *extra: str) -> RunConfig:
    return load_config(None, ["model.name_or_path=m", "data.train=builtin:sft_train.jsonl",
                              "training.per_device_batch_size=1", f"output_dir={out}", *extra])


def test_a_folder_left_before_the_first_logged_step_is_no_run(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("algorithm: dpo\n")
    (tmp_path / "metrics.jsonl").write_text("")
    assert run_marks(tmp_path) == [] and run_marks(tmp_path / "absent") == []
    assert check_reuse(config(tmp_path)) is None


def test_marks_algorithm_and_the_refusal(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("algorithm: dpo\n")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "final").mkdir()
    (tmp_path / "epoch_1").mkdir()
    assert run_marks(tmp_path) == ["metrics.jsonl", "epoch_1/", "final/"]
    assert run_algorithm(tmp_path) == "dpo"
    with pytest.raises(ConfigError, match=r"holds a run of dpo \(metrics\.jsonl, epoch_1/, final/\): resume with"):
        check_reuse(config(tmp_path))
    assert check_reuse(config(tmp_path, "checkpoint.resume_from=latest")) is None  # the same run goes on
    with pytest.raises(ConfigError, match="holds a run of dpo"):  # weights only: a new run
        check_reuse(config(tmp_path, f"checkpoint.resume_from={tmp_path}", "checkpoint.resume_weights_only=true"))


def test_overwrite_moves_the_folder_aside_whole(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "notes.txt").write_text("mine")
    (tmp_path / "run.old-1").mkdir()  # taken: the next number is used
    assert aside_path(out) == tmp_path / "run.old-2"
    line = check_reuse(config(out, "checkpoint.overwrite_output_dir=true"))
    assert line == f"output_dir: moved the previous run to {tmp_path / 'run.old-2'} (checkpoint.overwrite_output_dir)"
    assert not out.exists() and (tmp_path / "run.old-2" / "notes.txt").read_text() == "mine"


def test_the_run_lock_names_its_holder_and_dies_with_it(tmp_path: Path) -> None:
    """Issue 50.2: an OS lock (flock), not a marker file: held by a live process it refuses a second holder in one
    line naming the first's pid and host; the holder SIGKILLed, the lock is gone with it."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    from alignkit.train.output_dir import LOCK_FILE, OutputDirInUse, hold, release

    code = ("import sys, time; from pathlib import Path; from alignkit.train.output_dir import hold; "
            "hold(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputDirInUse) as err:
            hold(tmp_path)
        assert str(err.value) == (f"output_dir {str(tmp_path)!r} is in use by another run (pid {holder.pid} on host "
                                  f"{socket.gethostname()}); wait for it to end, or choose another output_dir")
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    finally:
        holder.kill()
        holder.wait()
    start = time.monotonic()
    hold(tmp_path)
    hold(tmp_path)  # this process again (a second run_train in one interpreter): a no-op
    assert time.monotonic() - start < 1.0
    assert (tmp_path / LOCK_FILE).read_text() == f"pid {os.getpid()} on host {socket.gethostname()}\n"
    release(tmp_path)
    release(tmp_path)
