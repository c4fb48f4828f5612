"""Preference learning under 2 processes (gloo): layout invariance, exact-once eval, the launch script.

One launch (``workers/pref_invariance.py``) checks, for DPO (sigmoid, ipo, simpo + label
smoothing, LoRA-base reference), the reward model, the cost model, ORPO and KTO (z0 from the KL pairs of
the whole step), that the loss and the
gradient of one optimizer step over the same 4 pairs (of different lengths) agree to 1e-5 for
1 rank x batch 4, 1 rank x accumulation 4, 2 ranks x batch 2 and 2 ranks x batch 1 x
accumulation 2; that reference log-probs precomputed by 2 ranks equal those of 1; and that
evaluation over an odd number of pairs gives the same metrics on 1 and 2 ranks.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, assert_ok, child_env, free_port, run_cli, run_script

pytestmark = pytest.mark.distributed

WORKERS = Path(__file__).parent / "workers"


def test_preference_losses_are_layout_invariant(micro_model: Path, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    proc = run_script(WORKERS / "pref_invariance.py", nproc=2, args=[str(micro_model), str(report)], timeout=600)
    assert_ok(proc)
    out = json.loads(report.read_text())
    assert out["failures"] == [], out["failures"]
    assert "ALL OK" in proc.stdout
    assert set(out["cases"]) == {"dpo_sigmoid", "dpo_ipo", "dpo_simpo_ls", "dpo_lora_base", "reward_model", "cost_model",
                                "orpo", "kto"}
    for case, row in out["cases"].items():
        assert set(row) == {"1x4", "1x1_ga4", "2x2", "2x1_ga2"}, case
    assert out["eval_1"]["rewards/accuracy"] == out["eval_2"]["rewards/accuracy"]


def test_train_rm_distributed_script(micro_model: Path, tmp_path: Path) -> None:
    """scripts/train_rm_distributed.sh harmless 2: a cost model on the safety pairs, 2 ranks, then eval."""
    out = tmp_path / "harmless_rm"
    env = child_env(MASTER_PORT=str(free_port()))
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "train_rm_distributed.sh"), "harmless", "2",
         f"model.name_or_path={micro_model}", f"output_dir={out}", "training.max_steps=3",
         "data.max_train_examples=64", "data.max_eval_examples=33", "logging.report_to=[jsonl]"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert_ok(proc)
    assert "Distributed training initialized: world_size=2" in proc.stderr
    assert (out / "final" / "config.json").is_file()
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "eval/accuracy" in line]
    assert evals and 0.0 <= evals[-1]["eval/accuracy"] <= 1.0 and "eval/sign_accuracy" in evals[-1]
    # `alignkit eval` under 2 processes: 33 pairs, each once, the numbers of the run's last evaluation
    proc = run_cli(["eval", str(REPO / "configs" / "rm_harmless.yaml"), f"model.name_or_path={micro_model}",
                    f"output_dir={out}", "data.max_eval_examples=33", "--out", str(tmp_path / "eval.json")], nproc=2)
    assert_ok(proc)
    got = json.loads((tmp_path / "eval.json").read_text())
    assert got["examples"] == 33
    for key in ("accuracy", "margin", "sign_accuracy"):
        assert abs(got[key] - evals[-1][f"eval/{key}"]) < 1e-5, key
