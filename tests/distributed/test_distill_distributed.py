"""On-policy distillation's chunked path (``distill.chunk_tokens``) under DDP (2 ranks, gloo): the student's
divergence is computed inside its wrapped forward, so DDP sees the LM head's use and averages its gradient; every
logged loss and gradient norm equals the full-vocabulary path's (measured: loss equal to 3e-10, grad norm equal)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignkit.models.tiny import build_tiny_model
from tests.conftest import assert_ok, run_script
from tests.integration.test_distill_cli import args

pytestmark = pytest.mark.distributed

TRAIN_MANY = Path(__file__).parent / "workers" / "train_many.py"


@pytest.mark.slow(seconds=60)
def test_chunked_distill_under_ddp_equals_the_full_path(micro_model: Path, tmp_path: Path) -> None:
    teacher = build_tiny_model(tmp_path / "teacher", size="micro", seed=1)
    runs = {"full": [], "chunked": ["distill.chunk_tokens=5"]}
    # both runs in ONE torchrun launch (workers/train_many.py takes a config and its overrides per run)
    launch = [a for name, extra in runs.items() for a in args(micro_model, teacher, tmp_path / name, "distill.beta=0.5",
                                                                "distributed.strategy=ddp", *extra)[1:]]
    assert_ok(run_script(TRAIN_MANY, nproc=2, args=launch, timeout=300))
    logged = {}
    for name in runs:
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        logged[name] = [(r["loss"], r["grad_norm"]) for r in rows if "distill_divergence" in r]
    assert len(logged["full"]) == len(logged["chunked"]) == 2
    for (loss_a, grad_a), (loss_b, grad_b) in zip(logged["full"], logged["chunked"]):
        assert loss_a == pytest.approx(loss_b, rel=1e-5) and grad_a == pytest.approx(grad_b, rel=1e-5)
        assert grad_b > 0
