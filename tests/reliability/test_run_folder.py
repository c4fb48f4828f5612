"""A run's folder (issue 50): one run at a time holds it, every folder it writes is whole, every log it appends is
rewound to the checkpoint a resume starts from, and a signal while it finishes does not cut it short.

- two runs at once into one ``output_dir``: the second is refused in one line naming the first's pid and host; the
  first SIGKILLed, the next run starts (the OS lock went with its process);
- a SIGTERM while the last checkpoint is written, or the one before pruned: the run ends whole (its line,
  ``final/``, no ``.trash-checkpoint-*``), exit 0;
- killed between the epoch's step checkpoint and its ``epoch_1/`` export, or in the middle of that export: no
  half ``epoch_1/`` is left, and the resumed run writes it from the checkpoint (the same weights);
- a GRPO run resumed from an earlier checkpoint: ``samples.jsonl`` equals the uninterrupted run's, no row twice.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alignkit.data.synth import make_prompt_rows, write_rows
from alignkit.train.output_dir import LOCK_FILE
from tests.conftest import REPO, assert_ok, child_env, run_cli, write_config

pytestmark = pytest.mark.slow


def sft_args(model: Path, out: Path, *extra: str) -> list[str]:
    return ["train", str(REPO / "configs" / "sft.yaml"), f"model.name_or_path={model}", f"output_dir={out}",
            "data.max_train_examples=16", "data.max_length=64", "training.per_device_batch_size=4",
            "training.learning_rate=1e-3", "logging.report_to=[jsonl]", "logging.logging_steps=1",
            "logging.plot=false", *extra]


def run_script(tmp_path: Path, body: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    """``alignkit ARGS`` after ``body`` (a fault injected into alignkit's code), forked from the warm fork server."""
    return run_cli(args, prelude=textwrap.dedent(body))


@pytest.mark.slow(seconds=40)
def test_a_second_run_into_a_held_folder_is_refused_and_a_killed_holders_lock_is_gone(micro_model: Path,
                                                                                      tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = sft_args(micro_model, out, "training.max_steps=400", "checkpoint.save_steps=1",
                    "checkpoint.resume_from=latest")
    # the first run, each step slowed to 0.5 s: it would hold the folder for 200 s (it is killed long before)
    first = subprocess.Popen([sys.executable, str(REPO / "tests" / "reliability" / "slow_steps.py"), "0.5", *args],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=child_env())
    try:
        deadline = time.monotonic() + 120
        while not (out / "latest").exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert first.poll() is None, first.stderr.read() if first.stderr else ""
        second = run_cli(args)  # the same command again: it would resume from the first's checkpoint and mix
        assert second.returncode == 2, second.stderr[-3000:]
        last = second.stderr.strip().splitlines()[-1]
        import socket

        assert last == (f"alignkit: error: output_dir {str(out)!r} is in use by another run (pid {first.pid} on host "
                        f"{socket.gethostname()}); wait for it to end, or choose another output_dir"), last
        assert "Resumed" not in second.stderr and first.poll() is None
        first.send_signal(signal.SIGKILL)
        first.wait()
    finally:
        first.kill()
        first.wait()
        if first.stderr:
            first.stderr.close()
    # the holder died without a word: its lock went with it, and the next run resumes its checkpoints
    step = int((out / "latest").read_text().removeprefix("checkpoint-"))
    proc = run_cli([*args, f"training.max_steps={step + 1}"])
    assert_ok(proc)
    assert f"Resumed from {out / f'checkpoint-{step}'} at step {step}" in proc.stderr
    # a run that ended (not killed) leaves the folder free too: resume into it again
    assert_ok(run_cli([*args, f"training.max_steps={step + 2}"]))
    assert (out / LOCK_FILE).is_file() and (out / "latest").read_text() == f"checkpoint-{step + 2}"


@pytest.mark.slow(seconds=25)
@pytest.mark.parametrize("moment", ["saving", "pruning"])
def test_sigterm_while_the_run_finishes_ends_it_whole(micro_model: Path, tmp_path: Path, moment: str) -> None:
    """SIGTERM sent to itself while the last checkpoint (step 2) is written, or while checkpoint-1 is pruned
    (save_total_limit=1): before, the handler was gone by then, and the run died by the signal (exit -15) with no
    line, no ``final/`` and a ``.trash-checkpoint-1-*`` left."""
    out = tmp_path / "run"
    args = sft_args(micro_model, out, "training.max_steps=2", "checkpoint.save_steps=1",
                    "checkpoint.save_total_limit=1", "checkpoint.save_final=true")
    if moment == "saving":
        body = """
            import os, signal
            from alignkit.train import checkpoint
            real = checkpoint._fsync_tree
            def terminated(path):
                if path.name == checkpoint.TMP_PREFIX + "2":
                    os.kill(os.getpid(), signal.SIGTERM)
                return real(path)
            checkpoint._fsync_tree = terminated
        """
    else:
        body = """
            import os, shutil, signal
            from pathlib import Path
            from alignkit.train import checkpoint
            real = shutil.rmtree
            def terminated(path, *a, **k):
                if Path(path).name.startswith(checkpoint.TRASH_PREFIX):
                    os.kill(os.getpid(), signal.SIGTERM)
                return real(path, *a, **k)
            checkpoint.shutil.rmtree = terminated
        """
    proc = run_script(tmp_path, body, args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SIGTERM received while the run was finishing: it finished first" in proc.stderr
    assert (out / "final" / "model.safetensors").is_file() and "Run finished" in proc.stderr
    assert not list(out.glob(".trash-*")) and not list(out.glob(".tmp-*"))
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-2"]


@pytest.mark.slow(seconds=40)
@pytest.mark.parametrize("moment", ["after_checkpoint", "mid_export"])
def test_epoch_folder_is_whole_and_written_again_by_the_resume(micro_model: Path, tmp_path: Path,
                                                              moment: str) -> None:
    """16 examples / 4 = 4 steps an epoch, 2 epochs, a checkpoint at step 4 (the epoch's end). SIGKILL after
    checkpoint-4 but before ``epoch_1/`` (before: the finished run had no ``epoch_1/``), or inside its export after
    its files were written but before they are in place (before: a half ``epoch_1/``)."""
    out = tmp_path / "run"
    args = sft_args(micro_model, out, "training.epochs=2", "checkpoint.save_steps=4",
                    "checkpoint.save_each_epoch=true", "checkpoint.resume_from=latest")
    if moment == "after_checkpoint":
        body = """
            import os, signal
            from alignkit.train.step import Checkpointer
            def killed(self, final_dir, *a, **k):
                if final_dir.name == "epoch_1":
                    os.kill(os.getpid(), signal.SIGKILL)
            Checkpointer.save_final = killed
        """
    else:
        body = """
            import os, signal
            from alignkit.train import checkpoint
            real = checkpoint.put_in_place
            def killed(tmp, final):
                if final.name == "epoch_1":
                    (tmp / "config.json").write_text("")  # as a write cut short left it
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(tmp, final)
            checkpoint.put_in_place = killed
        """
    proc = run_script(tmp_path, body, args)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert (out / "checkpoint-4").is_dir() and not (out / "epoch_1").exists()
    resumed = run_cli(args)
    assert_ok(resumed)
    assert "Resumed from" in resumed.stderr and not list(out.glob(".tmp-*"))
    from transformers import AutoModelForCausalLM

    for n in (1, 2):
        AutoModelForCausalLM.from_pretrained(out / f"epoch_{n}")
    epoch_1 = load_file(str(out / "epoch_1" / "model.safetensors"))
    at_4 = load_file(str(out / "checkpoint-4" / "policy" / "model.safetensors"))
    assert epoch_1.keys() == at_4.keys() and all(torch.equal(epoch_1[k], at_4[k]) for k in at_4)


@pytest.mark.slow(seconds=30)
def test_samples_log_is_rewound_on_resume(micro_model: Path, tmp_path: Path) -> None:
    """GRPO, 4 iterations of one step, a checkpoint each; resumed from checkpoint-2 the run logs steps 3 and 4 again:
    before, samples.jsonl then held their rows twice (appended, not rewound as metrics.jsonl is), and TensorBoard
    showed them twice."""
    out = tmp_path / "run"
    prompts = write_rows(make_prompt_rows(24, seed=0), tmp_path / "prompts.jsonl")
    cfg = {"algorithm": "grpo", "output_dir": str(out), "model": {"name_or_path": str(micro_model)},
           "data": {"train": str(prompts), "max_length": 48},
           "rollout": {"num_generations": 4, "max_new_tokens": 4, "log_samples": 3},
           "reward": {"functions": [{"name": "length", "weight": 1.0}]},
           "training": {"per_device_batch_size": 8, "learning_rate": 1e-3, "max_steps": 4},
           "checkpoint": {"save_steps": 1, "save_final": False},
           "logging": {"logging_steps": 1, "plot": False, "report_to": ["jsonl", "tensorboard"]}}
    config = write_config(tmp_path / "grpo.yaml", cfg)
    assert_ok(run_cli(["train", str(config)]))
    straight = (out / "samples.jsonl").read_text(encoding="utf-8")
    assert [json.loads(x)["step"] for x in straight.splitlines()] == [s for s in (1, 2, 3, 4) for _ in range(3)]
    shutil.copy(out / "metrics.jsonl", tmp_path / "metrics.straight")
    proc = run_cli(["train", str(config), f"checkpoint.resume_from={out / 'checkpoint-2'}"])
    assert_ok(proc)
    assert (out / "samples.jsonl").read_text(encoding="utf-8") == straight
    assert "samples.jsonl: dropped 6 rows logged after step 2 by the interrupted run" in proc.stderr
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    # TensorBoard's event files, as its own reader shows them: the resumed run's steps 3 and 4 replace the first's
    # (the writer reopened with purge_step=3); before, both runs' steps 3 and 4 were shown
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4]
