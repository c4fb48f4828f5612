"""A fake two-role algorithm (actor + critic on the micro model) through the real runner and loop.

The actor is trained with the SFT loss; the critic (a scalar head on its own copy of the micro model)
regresses each sequence's length / 10. Both are trainable roles: two Strategy handles, two
optimizers and schedules, two folders per checkpoint. One launch runs the straight run (4 steps,
checkpoint at 2), then a second run that starts from a copy of checkpoint-2 and resumes to step 4,
and writes a JSON report (losses of both, final weights of both roles). Several strategies run one after
another in the same launch (a launch's start-up costs more than the runs), each in OUT_DIR/STRATEGY.

Usage: ``[torchrun --nproc_per_node=2] two_roles.py MODEL_DIR OUT_DIR STRATEGY [STRATEGY ...]``
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from alignkit.algorithms import ALGORITHMS
from alignkit.algorithms.base import Batch, OfflineAlgorithm
from alignkit.algorithms.sft import sft_example
from alignkit.config import RunConfig, load_config
from alignkit.data.pipelines import TokenData
from alignkit.distributed.comm import exit_process
from alignkit.losses.sft import sft_loss
from alignkit.metrics import MetricSums
from alignkit.models.policy import forward_logps, model_inputs
from alignkit.models.roles import Models, ModelSpec
from alignkit.train.runner import run_train


class ActorCritic(OfflineAlgorithm):
    name = "actor_critic_test"

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        super().__init__(cfg, tokenizer, TokenData(
            tokenizer, cfg.data, lambda row: sft_example(tokenizer, row, max_length=cfg.data.max_length)))

    @classmethod
    def model_specs(cls, cfg: RunConfig) -> list[ModelSpec]:
        src = cfg.model.name_or_path
        return [ModelSpec("policy", src, "lm", trainable=True), ModelSpec("value", src, "scalar", trainable=True)]

    def loss(self, models: Models, batch: Batch, *, normalizer: float) -> tuple[dict[str, torch.Tensor], MetricSums]:
        logps = forward_logps(models["policy"], batch)
        n_seqs = int(batch["seq_index"].max()) + 1
        values = models["value"](seq_index=batch["seq_index"], num_seqs=n_seqs, **model_inputs(batch))
        lengths = torch.bincount(batch["seq_index"][batch["seq_index"] >= 0], minlength=n_seqs).float()
        value_loss = ((values - lengths / 10) ** 2).sum() / normalizer
        m = MetricSums()
        m.add_mean("value_mse", (values.detach() - lengths / 10) ** 2)
        return {"policy": sft_loss(logps, normalizer=normalizer), "value": value_loss}, m

    @torch.no_grad()
    def eval_step(self, models: Models, batch: Batch) -> MetricSums:
        return MetricSums()


def config(model_dir: str, out: Path, strategy: str, world: int, *extra: str) -> RunConfig:
    return load_config(None, [
        "algorithm=actor_critic_test", f"model.name_or_path={model_dir}", f"output_dir={out}",
        "data.train=builtin:sft_train.jsonl", "data.max_length=64", "data.max_train_examples=64", "data.packing=true",
        f"training.per_device_batch_size={4 // world}", "training.learning_rate=1e-3", "training.max_steps=4",
        "training.lr_scheduler=linear", "training.seed=0", "checkpoint.save_steps=2", "logging.report_to=[jsonl]",
        "logging.logging_steps=1", f"distributed.strategy={strategy}", "distributed.deepspeed.zero_stage=2", *extra,
    ])


def main(model_dir: str, out_dir: str, strategies: list[str]) -> None:
    ALGORITHMS.register("actor_critic_test")(ActorCritic)
    for strategy in strategies:
        straight_and_resumed(model_dir, Path(out_dir) / strategy, strategy)
        if dist.is_initialized():
            dist.barrier()


def straight_and_resumed(model_dir: str, root: Path, strategy: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    straight = run_train(config(model_dir, root / "straight", strategy, world))
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0:
        shutil.copytree(root / "straight" / "checkpoint-2", root / "resumed" / "checkpoint-2")
        (root / "resumed" / "latest").write_text("checkpoint-2")
    if dist.is_initialized():
        dist.barrier()
    resumed = run_train(config(model_dir, root / "resumed", strategy, world, "checkpoint.resume_from=latest"))
    if rank0:
        report = {"straight": straight.losses, "resumed": resumed.losses, "weights": {}}
        for folder in ("final", "final_value"):
            a = load_file(str(root / "straight" / folder / "model.safetensors"))
            b = load_file(str(root / "resumed" / folder / "model.safetensors"))
            report["weights"][folder] = {"max_diff": max((a[k] - b[k]).abs().max().item() for k in a),
                                         "keys": len(a), "same_keys": sorted(a) == sorted(b)}
        mid = load_file(str(root / "straight" / "checkpoint-2" / "value" / "model.safetensors"))
        end = load_file(str(root / "straight" / "final_value" / "model.safetensors"))
        report["value_moved"] = max((mid[k] - end[k]).abs().max().item() for k in mid)
        report["checkpoint_roles"] = sorted(p.name for p in (root / "straight" / "checkpoint-2").iterdir() if p.is_dir())
        rows = [json.loads(x) for x in (root / "straight" / "metrics.jsonl").read_text().splitlines()]
        report["logged"] = [{k: r.get(k) for k in ("step", "loss", "loss/value", "grad_norm", "grad_norm/value",
                                                    "value_mse")} for r in rows if "loss" in r]
        (root / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
    exit_process(0, barrier=True)
