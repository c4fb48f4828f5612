"""Issue 50's launcher items without training: one count check on every path (50.1), what the sbatch script and
the manifest say about the machine that wrote them (50.6), the launcher's filter of a worker's error and the CPU
note (50.8), ``--partition`` and the usage and help texts (50.11). The processes: tests/distributed/test_launch_failures.py."""

from __future__ import annotations

import os
import sys

import pytest
import yaml

from alignkit.cli import main
from alignkit.cli.parser import ALGORITHM_NAMES, build_parser, recipes
from alignkit.launch.run import FirstError
from alignkit.launch.slurm import dry_run_script
from alignkit.launch.torchrun import build_launch
from tests.conftest import REPO

CFG = str(REPO / "configs" / "sft.yaml")


def one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """``alignkit ARGV`` in this process: exit status 2 and one line on stderr, returned."""
    assert main(argv) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and err[0].startswith("alignkit: error: "), err
    return err[0]


@pytest.mark.parametrize("counts", [["--nnodes", "0"], ["--nproc-per-node", "0"], ["--nnodes", "-1"]])
def test_a_count_below_one_is_refused_alike_on_every_path(capsys: pytest.CaptureFixture[str], counts) -> None:
    """50.1: `--slurm --dry-run --nnodes 0` wrote `--nodes=1`, `--nproc-per-node 0` was dropped, `--k8s --nnodes 0`
    gave `replicas: 1` (``nnodes or 1``); now every path says the plain launch's line."""
    plain = one_line(capsys, ["launch", "--dry-run", *counts, CFG])
    assert plain == f"alignkit: error: --nproc-per-node and --nnodes must be >= 1, got {' '.join(counts)}"
    assert one_line(capsys, ["launch", "--slurm", "--dry-run", *counts, CFG]) == plain
    assert one_line(capsys, ["launch", "--k8s", "--image", "x:1", *counts, CFG]) == plain
    # and the library functions the cluster paths call refuse them too (no `or 1` default behind the CLI)
    with pytest.raises(ValueError, match="must be >= 1"):
        dry_run_script(CFG, [], nproc_per_node=0, nnodes=None, master_port=None, launcher="torchrun", job_name="j")


def test_sbatch_runs_this_interpreter_and_logs_under_output_dir(capsys: pytest.CaptureFixture[str]) -> None:
    """50.6: the script ran `python` from PATH and wrote `%x-%j.out` into the folder it was submitted from (the
    repository); `--partition` was only an edit of the script (50.11)."""
    assert main(["launch", "--slurm", "--dry-run", "--partition", "gpu-long", CFG, "output_dir=runs/exp 1"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert "#SBATCH --output=runs/exp 1/slurm-%x-%j.out" in lines
    assert "#SBATCH --partition=gpu-long" in lines
    assert f'exec "${{PYTHON:-{sys.executable}}}" -m alignkit launch --slurm' in out
    assert "mkdir -p runs/exp 1 before sbatch" in err  # Slurm does not create the log's folder
    # without --partition the line stays a comment to fill in
    script = dry_run_script(CFG, [], nproc_per_node=None, nnodes=2, master_port=None, launcher="torchrun",
                            job_name="j", py="/opt/venv/bin/python", output_dir="/scratch/run/")
    assert "##SBATCH --partition=YOUR_PARTITION" in script.splitlines()
    assert "#SBATCH --output=/scratch/run/slurm-%x-%j.out" in script.splitlines()
    assert 'exec "${PYTHON:-/opt/venv/bin/python}"' in script


def test_partition_only_goes_with_the_sbatch_script(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--partition goes with --slurm" in one_line(capsys, ["launch", "--dry-run", "--partition", "p", CFG])


def test_k8s_warns_of_a_local_model_path(capsys: pytest.CaptureFixture[str], micro_model, tmp_path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """50.6: a relative local `model.name_or_path` went into the manifest without a word; the pods do not have it.
    A warning (one line on stderr, the manifest still on stdout): the image or the claim may hold the same path."""
    (tmp_path / "runs").mkdir()
    os.symlink(micro_model, tmp_path / "runs" / "tiny-model")
    monkeypatch.chdir(tmp_path)
    assert main(["launch", "--k8s", "--image", "x:1", CFG, "model.name_or_path=runs/tiny-model"]) == 0
    out, err = capsys.readouterr()
    warnings = [x for x in err.splitlines() if "warning" in x]
    assert len(warnings) == 1 and "model.name_or_path=runs/tiny-model is a path on this machine" in warnings[0]
    assert "unless the image holds it" in warnings[0]
    assert len(list(yaml.safe_load_all(out))) == 2  # stdout is still the manifest alone
    assert main(["launch", "--k8s", "--image", "x:1", "--pvc", "data", CFG,
                 "model.name_or_path=runs/tiny-model"]) == 0
    assert "the claim data holds /workspace/runs/tiny-model" in capsys.readouterr().err
    # a hub id is not a local path: no warning
    assert main(["launch", "--k8s", "--image", "x:1", CFG, "model.name_or_path=Qwen/Qwen2-0.5B"]) == 0
    assert "warning" not in capsys.readouterr().err


#: what torchrun (torch 2.13) printed after a worker's one-line error under `alignkit launch` (abridged: the
#: traceback's frames and the time / host / error_file lines left out)
TORCHRUN_TAIL = b"""W1128 19:00:01.123000 4242 torch/distributed/elastic/multiprocessing/api.py:908] Sending process 4244 closing signal SIGTERM
E1128 19:00:01.456000 4242 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 2) local_rank: 0 (pid: 4243) of binary: /usr/bin/python
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
alignkit FAILED
------------------------------------------------------------
Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 4244)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 2 (pid: 4243)
============================================================
"""


def _filtered(stream: bytes, status: int, size: int) -> tuple[bytes, int]:
    out = bytearray()
    first = FirstError(out.extend)
    for i in range(0, len(stream), size):  # the pipe hands over arbitrary pieces
        first.feed(stream[i:i + size])
    status = first.exit_status(status)
    return bytes(out), status


@pytest.mark.parametrize("size", [1, 7, 65536])
def test_a_workers_error_line_once_and_its_status(size: int) -> None:
    """50.8: ~90 lines of torchrun after the worker's line and exit 1; now the line once and the worker's 2."""
    before = b"Pre-flight OK: 2 ranks reachable\r\ntrain:  10%|#   | 1/10\r"
    line = b"alignkit: error: data file 'x.jsonl' does not exist\n"
    late = b"alignkit: error: (rank 1) data file 'x.jsonl' does not exist\n"
    out, status = _filtered(before + line + late + TORCHRUN_TAIL, 1, size)
    assert out == before + line and status == 2
    # no error line: everything passes, the launcher's status stands
    out, status = _filtered(before + TORCHRUN_TAIL, 1, size)
    assert out == before + TORCHRUN_TAIL and status == 1
    # a run that ends well after such a line (nothing failed) keeps all it printed
    out, status = _filtered(before + line + b"done\n", 0, size)
    assert out == before + line + b"done\n" and status == 0
    # the first failure's own status when torchrun names it (a worker's exit 3), 2 when it does not
    assert _filtered(line + TORCHRUN_TAIL.replace(b"exitcode  : 2", b"exitcode  : 3"), 1, size)[1] == 3
    assert _filtered(line, 1, size)[1] == 2


def test_cpu_launch_says_what_it_is_about_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """50.8: `--nproc-per-node 8` on 2 cores without a GPU started silently; now one line says so."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    notes = build_launch(CFG, [], nproc_per_node=8, master_port=29612, gpus=0).notes
    assert notes == [("no GPU here: 8 CPU process(es) per node over gloo on 2 CPU core(s), OMP_NUM_THREADS=1 each; "
                      "8 processes on 2 cores take turns, so each step is slower than on one process")]
    assert build_launch(CFG, [], nproc_per_node=2, master_port=29612, gpus=2).notes == []


def test_launch_errors_show_launchs_usage(capsys: pytest.CaptureFixture[str]) -> None:
    """50.11: an unknown option of `launch` printed the top-level usage (`alignkit [-h] {train,...}`)."""
    with pytest.raises(SystemExit) as e:
        main(["launch", "--no-such-option", CFG])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: alignkit launch ") and "--partition" in err
    assert "alignkit launch: error: unrecognized arguments: --no-such-option" in err


def test_help_lists_the_algorithms_the_recipes_and_the_docs() -> None:
    """50.11; the algorithms are written out in the parser (no torch for --help): they must be the registered ones."""
    import alignkit.algorithms

    assert sorted(ALGORITHM_NAMES) == sorted(alignkit.algorithms.ALGORITHMS)
    text = " ".join(build_parser().format_help().split())
    assert "algorithms (algorithm=NAME in a config): " + ", ".join(ALGORITHM_NAMES) in text
    assert "sft.yaml" in recipes() and "grpo.yaml" in recipes()
    assert all(name in text for name in recipes())
    assert "documentation: docs/index.md" in text


def test_separate_placement_without_a_trainer_is_refused_before_torchrun(capsys: pytest.CaptureFixture[str]) -> None:
    """``rollout.generator_processes`` as large as the launched world leaves no trainer: `alignkit launch` (its dry
    run too) says so in one line before starting torchrun (it printed the command and every rank failed after
    start-up); one fewer generator passes."""
    grpo = str(REPO / "configs" / "grpo.yaml")
    sep = ["rollout.placement=separate", "rollout.generator_processes=2"]
    line = one_line(capsys, ["launch", "--dry-run", "--nproc-per-node", "2", grpo, *sep])
    assert "rollout.generator_processes (2): the launcher starts 2" in line
    assert "the launcher starts 4" in one_line(capsys, ["launch", "--dry-run", "--nnodes", "2", "--nproc-per-node",
                                                        "2", "--node-rank", "0", "--master-addr", "n0", grpo,
                                                        "rollout.placement=separate", "rollout.generator_processes=4"])
    assert main(["launch", "--dry-run", "--nproc-per-node", "3", grpo, *sep]) == 0


def test_separate_placement_of_an_unsplit_rollout_is_refused_by_validate_and_dry_run(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Red teaming (or GRPO with DAPO's dynamic sampling) has a rollout of its own that separate placement does not
    split yet: `alignkit validate` and `alignkit launch --dry-run` now say so in the runner's one line (they passed,
    and only the started ranks refused)."""
    redteam = str(REPO / "configs" / "redteam.yaml")
    want = "alignkit: error: rollout.placement: separate: the redteam algorithm"
    assert one_line(capsys, ["launch", "--dry-run", "--nproc-per-node", "2", redteam,
                             "rollout.placement=separate"]).startswith(want)
    assert one_line(capsys, ["validate", redteam, "rollout.placement=separate"]).startswith(want)
    grpo = [str(REPO / "configs" / "grpo.yaml"), "rollout.placement=separate", "grpo.dynamic_sampling=true"]
    assert "the grpo algorithm" in one_line(capsys, ["validate", *grpo])


def test_separate_placement_with_an_uneven_generator_split_is_refused_by_dry_run(
        capsys: pytest.CaptureFixture[str]) -> None:
    """An iteration's completions that do not split evenly over ``rollout.generator_processes`` were refused only
    by the started ranks; `alignkit launch --dry-run` now counts the batch over the trainers and says so first."""
    grpo = [str(REPO / "configs" / "grpo.yaml"), "rollout.placement=separate", "rollout.generator_processes=3",
            "training.per_device_batch_size=8", "training.gradient_accumulation_steps=1"]
    line = one_line(capsys, ["launch", "--dry-run", "--nproc-per-node", "4", *grpo])
    assert "an iteration's 8 completions must split evenly over rollout.generator_processes (3)" in line
    assert "with 1 trainer processes of the 4 launched" in line
    assert main(["launch", "--dry-run", "--nproc-per-node", "6", *grpo]) == 0  # 3 trainers: 24 completions
    even = [*grpo[:2], "rollout.generator_processes=2", *grpo[3:]]
    assert main(["launch", "--dry-run", "--nproc-per-node", "3", *even]) == 0
