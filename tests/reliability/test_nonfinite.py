"""Non-finite losses and gradients (issue: a NaN run exited 0 and wrote NaN checkpoints): detected on every
rank at the same step, the update dropped, training stopped with a one-line error after
``training.max_nonfinite_steps`` in a row (or at once with ``training.nonfinite=stop``), and no checkpoint
ever holds non-finite weights."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import REPO, assert_ok, run_cli, run_script


def sft_args(model: Path, out: Path, *extra: str) -> list[str]:
    return ["train", str(REPO / "configs" / "sft.yaml"), f"model.name_or_path={model}", f"output_dir={out}",
            "data.max_train_examples=64", "data.max_length=64", "training.per_device_batch_size=4",
            "training.max_steps=12", "logging.report_to=[jsonl]", "logging.logging_steps=1", "logging.plot=false",
            "checkpoint.save_steps=1", *extra]


@pytest.mark.parametrize("policy,stop_step", [("skip", 6), ("stop", 2)])
def test_exploding_run_stops_with_one_line_and_finite_checkpoints(micro_model: Path, tmp_path: Path,
                                                                   policy: str, stop_step: int) -> None:
    """From step 2 on the loss is NaN (as a diverged run's is; learning rates above 1 are refused at load)."""
    out = tmp_path / policy
    prelude = textwrap.dedent("""
        from alignkit.algorithms import sft
        real, calls = sft.sft_loss, []
        def diverged(*a, **k):
            calls.append(1)
            loss = real(*a, **k)
            return loss * float("nan") if len(calls) > 1 else loss
        sft.sft_loss = diverged
    """)
    proc = run_cli(sft_args(micro_model, out, f"training.nonfinite={policy}", "training.max_nonfinite_steps=5"),
                   prelude=prelude)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"alignkit: error: step {stop_step}: the loss (") and "not finite; stopping" in last, last
    assert "Traceback" not in proc.stderr
    if policy == "skip":
        assert proc.stderr.count("optimizer step skipped") == 4  # steps 2-5 dropped, step 6 stops
    assert not (out / "final").exists()
    latest = out / (out / "latest").read_text().strip() / "policy"
    weights = load_file(str(latest / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())
    steps = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert steps[-1] == stop_step - 1 and latest.parent.name == f"checkpoint-{stop_step - 1}"  # none after the stop
    rows = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]  # no evals
    assert rows[stop_step - 2]["loss"] is None or not math.isfinite(rows[stop_step - 2]["loss"]) or policy == "stop"


def test_nan_on_one_rank_skips_the_step_on_every_rank(micro_model: Path, tmp_path: Path) -> None:
    """Rank 1's loss is NaN at step 2 only: both ranks drop step 2, stay identical and finite, and go on."""
    report = tmp_path / "report.json"
    assert_ok(run_script(Path(__file__).parent / "nan_once_worker.py", nproc=2, timeout=300,
                         args=[str(micro_model), str(tmp_path / "run"), str(report)]))
    r = json.loads(report.read_text())
    assert r["steps"] == [1, 2, 3, 4]
    assert r["loss"][1] is None and all(x is not None and math.isfinite(x) for i, x in enumerate(r["loss"]) if i != 1)
    assert r["skipped_lines"] == 1 and r["finite"] and r["ranks_equal"]
    assert r["step2_unchanged"]  # the dropped update left the weights as step 1 made them
