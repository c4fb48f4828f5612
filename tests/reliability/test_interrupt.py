"""Ctrl-C / SIGTERM mid-run (``checkpoint.save_on_interrupt``, issue 41.6): the run saves a checkpoint at the
step it was at, ends with one line naming it and the resume command and exits 128 + the signal; resumed with
``checkpoint.resume_from=latest`` it ends with exactly the weights of an uninterrupted run. Alone and under
torchrun with 2 processes (the signal sent to torchrun, which forwards it)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alignkit.train.interrupt import REPEAT_S
from tests.conftest import REPO, assert_ok, child_env, free_port, run_cli, run_script

STEPS = 12
WORKER = Path(__file__).parent / "slow_steps.py"
TRAIN_MANY = Path(__file__).parents[1] / "distributed" / "workers" / "train_many.py"


def args(model: Path, out: Path, *extra: str, config: str = "sft.yaml") -> list[str]:
    return ["train", str(REPO / "configs" / config), f"model.name_or_path={model}", f"output_dir={out}",
            "data.max_train_examples=64", "data.max_length=64", "training.per_device_batch_size=2",
            f"training.max_steps={STEPS}", "training.learning_rate=1e-3", "logging.report_to=[jsonl]",
            "logging.logging_steps=1", "logging.plot=false", *extra]


#: an online run (GRPO, 2 prompts x 4 generations per iteration): a checkpoint falls on an iteration's end
GRPO = ("rollout.num_generations=4", "training.per_device_batch_size=8", "training.eval_steps=null", "data.eval=[]")


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "model.safetensors"))


def logged_steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if '"loss"' in x] if path.exists() else []
    return [r["step"] for r in rows]


def interrupt(cmd: list[str], out: Path, sig: signal.Signals) -> subprocess.CompletedProcess[str]:
    """Start ``cmd``, send ``sig`` once step 2 is logged, wait for the end."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    deadline = time.monotonic() + 240
    while max(logged_steps(out), default=0) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=240)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def check_interrupted(proc: subprocess.CompletedProcess[str], out: Path, sig: signal.Signals) -> int:
    """The worker's exit, its one line (the last of stderr) and the checkpoint it names; returns its step."""
    lines = [x for x in proc.stderr.splitlines() if x.startswith("alignkit: ")]
    assert lines and lines[-1].startswith(f"alignkit: interrupted by {sig.name} at step "), proc.stderr[-3000:]
    frames = [x for x in proc.stderr.splitlines() if x.lstrip().startswith('File "')]
    assert not [x for x in frames if "alignkit" in x], proc.stderr[-3000:]  # torchrun's own SignalException aside
    step = int(lines[-1].split(" at step ")[1].split(":")[0])
    assert 2 <= step < STEPS
    assert f": saved {out / f'checkpoint-{step}'}; resume with" in lines[-1]
    assert lines[-1].endswith(" checkpoint.resume_from=latest"), lines[-1]
    assert (out / "latest").read_text().strip() == f"checkpoint-{step}"
    assert not (out / "final").exists()
    return step


@pytest.fixture(scope="module")
def straight(micro_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    out = tmp_path_factory.mktemp("interrupt") / "straight"
    assert_ok(run_cli(args(micro_model, out)))
    return final_weights(out)


@pytest.mark.slow(seconds=20)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_mid_run_saves_then_resume_equals_an_uninterrupted_run(micro_model: Path, tmp_path: Path,
                                                                      straight: dict, sig: signal.Signals) -> None:
    out = tmp_path / "run"
    proc = interrupt([sys.executable, str(WORKER), "0.3", *args(micro_model, out)], out, sig)
    assert proc.returncode == 128 + sig, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    step = check_interrupted(proc, out, sig)
    resumed = run_cli(args(micro_model, out, "checkpoint.resume_from=latest"))
    assert_ok(resumed)
    assert f"at step {step} " in resumed.stderr
    assert logged_steps(out) == list(range(1, STEPS + 1))
    got = final_weights(out)
    assert max((got[k] - straight[k]).abs().max().item() for k in straight) == 0.0


@pytest.mark.slow(seconds=45)
@pytest.mark.distributed
def test_sigterm_to_torchrun_two_processes_then_resume_equals_an_uninterrupted_run(micro_model: Path,
                                                                                    tmp_path: Path) -> None:
    straight_out, out = tmp_path / "straight", tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    proc = interrupt([*torchrun, str(WORKER), "0.3", *args(micro_model, out)], out, signal.SIGTERM)
    assert proc.returncode == 1, proc.stderr[-3000:]  # torchrun's status for a SignalException (workers: 143)
    check_interrupted(proc, out, signal.SIGTERM)
    assert proc.stderr.count("alignkit: interrupted") == 1  # rank 0 says it
    assert "(under the same launcher)" in proc.stderr
    # the resume, then the uninterrupted run, in ONE torchrun launch (train_many: a launch costs more than a run)
    resume, straight = args(micro_model, out, "checkpoint.resume_from=latest")[1:], args(micro_model, straight_out)[1:]
    assert_ok(run_script(TRAIN_MANY, nproc=2, args=[*resume, *straight], timeout=300))
    assert logged_steps(out) == list(range(1, STEPS + 1))
    got, want = final_weights(out), final_weights(straight_out)
    assert max((got[k] - want[k]).abs().max().item() for k in want) == 0.0


@pytest.mark.distributed
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_check() -> None:
    """The flags are summed over ranks on the host: rank 0, which got no signal, stops too; the check costs
    tens of microseconds (a 1-float gloo all-reduce), once per optimizer step."""
    proc = run_script(Path(__file__).parent / "interrupt_worker.py", nproc=2, args=["ranks"], timeout=120)
    assert_ok(proc)
    rows = sorted((json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")), key=lambda r: r["rank"])
    assert [(r["before"], r["after"]) for r in rows] == [(None, signal.SIGTERM), (None, signal.SIGTERM)]
    assert max(r["per_call_us"] for r in rows) < 5000  # measured ~tens of us on 2 shared CPU cores


@pytest.mark.parametrize("delay,stopped", [(0.1, False), (REPEAT_S + 0.5, True)], ids=["forwarded", "second"])
def test_a_second_signal_stops_at_once_unless_it_repeats_the_first(delay: float, stopped: bool) -> None:
    """A repeat within REPEAT_S is the same request (torchrun forwarding what the terminal sent to its
    workers already); a later one ends the process by the signal, with one line and no checkpoint."""
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "interrupt_worker.py"), "twice", str(delay)],
                          check=False, capture_output=True, text=True, timeout=60, env=child_env())
    if stopped:
        assert proc.returncode == -signal.SIGINT and "still running" not in proc.stdout
        assert proc.stderr.strip() == "alignkit: SIGINT again: stopping at once, without a checkpoint"
    else:
        assert proc.returncode == 0 and f"requested={int(signal.SIGINT)}" in proc.stdout, proc.stderr


@pytest.mark.slow(seconds=25)
def test_sigterm_mid_online_run_then_resume_equals_an_uninterrupted_run(micro_model: Path, tmp_path: Path) -> None:
    straight_out, out = tmp_path / "straight", tmp_path / "run"
    assert_ok(run_cli(args(micro_model, straight_out, *GRPO, config="grpo.yaml")))
    proc = interrupt([sys.executable, str(WORKER), "0.3", *args(micro_model, out, *GRPO, config="grpo.yaml")], out,
                     signal.SIGTERM)
    assert proc.returncode == 143 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    check_interrupted(proc, out, signal.SIGTERM)
    assert_ok(run_cli(args(micro_model, out, *GRPO, "checkpoint.resume_from=latest", config="grpo.yaml")))
    assert logged_steps(out) == list(range(1, STEPS + 1))
    got, want = final_weights(out), final_weights(straight_out)
    assert max((got[k] - want[k]).abs().max().item() for k in want) == 0.0


def test_ctrl_c_with_save_on_interrupt_off_is_one_line_and_130(micro_model: Path, tmp_path: Path) -> None:
    """checkpoint.save_on_interrupt=false: Ctrl-C stops at once (no checkpoint), one line, no traceback."""
    out = tmp_path / "run"
    proc = interrupt([sys.executable, str(WORKER), "0.3", *args(micro_model, out, "checkpoint.save_on_interrupt=false")],
                     out, signal.SIGINT)
    assert proc.returncode == 130 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("alignkit: interrupted; nothing saved now")
    assert not list(out.glob("checkpoint-*"))
