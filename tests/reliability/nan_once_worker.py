"""2-process DDP SFT where rank 1's loss is NaN at step 2 only (see test_nonfinite.py).

Usage: ``torchrun --nproc_per_node=2 nan_once_worker.py MODEL_DIR OUT_DIR REPORT.json``
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from alignkit.algorithms import ALGORITHMS
from alignkit.algorithms.sft import SFT
from alignkit.config import load_config
from alignkit.distributed.comm import exit_process
from alignkit.train.runner import run_train
from alignkit.train.step import Checkpointer

SNAPSHOTS: dict[int, dict[str, torch.Tensor]] = {}


class NanOnce(SFT):
    name = "nan_once_test"
    calls = 0

    def loss(self, models: Any, batch: Any, *, normalizer: float) -> Any:
        NanOnce.calls += 1
        loss, m = super().loss(models, batch, normalizer=normalizer)
        if NanOnce.calls == 2 and int(os.environ.get("RANK", "0")) == 1:
            loss = loss * float("nan")
        return loss, m

    def on_step_end(self, ctx: Any) -> dict[str, float]:
        return {}


def main(model_dir: str, out: str, report: str) -> None:
    ALGORITHMS.register("nan_once_test")(NanOnce)
    real_save = Checkpointer.save

    def save(self: Checkpointer, state: Any) -> Path:  # snapshot the weights after each step
        SNAPSHOTS[state.step] = {k: v.detach().clone() for k, v in self.models[self.models.primary].module.state_dict().items()}
        return real_save(self, state)

    Checkpointer.save = save  # type: ignore[method-assign]
    text = io.StringIO()
    logging.getLogger("alignkit").addHandler(logging.StreamHandler(text))
    cfg = load_config(None, [
        "algorithm=nan_once_test", f"model.name_or_path={model_dir}", f"output_dir={out}",
        "data.train=builtin:sft_train.jsonl", "data.max_length=64", "data.max_train_examples=64",
        "training.per_device_batch_size=2", "training.max_steps=4", "training.learning_rate=1e-3",
        "logging.report_to=[jsonl]", "logging.logging_steps=1", "logging.plot=false", "checkpoint.save_steps=1",
        "distributed.strategy=ddp",
    ])
    run_train(cfg)
    params = torch.cat([p.detach().reshape(-1) for p in SNAPSHOTS[4].values()])
    gathered = [torch.zeros_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, params)
    if dist.get_rank() == 0:
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
        Path(report).write_text(json.dumps({
            "steps": [r["step"] for r in rows], "loss": [r["loss"] for r in rows],
            "skipped_lines": text.getvalue().count("optimizer step skipped"),
            "finite": bool(torch.isfinite(params).all()),
            "ranks_equal": all(torch.equal(gathered[0], g) for g in gathered[1:]),
            "step2_unchanged": all(torch.equal(SNAPSHOTS[1][k], SNAPSHOTS[2][k]) for k in SNAPSHOTS[1]),
        }))


if __name__ == "__main__":
    main(*sys.argv[1:4])
    exit_process(0, barrier=True)
