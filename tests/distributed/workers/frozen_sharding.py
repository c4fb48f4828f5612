"""Worker: DPO runs whose frozen reference is replicated or sharded, in ONE launched process group.

Runs each config like ``train_many.py`` and records, on every rank, what ``prepare_frozen``
returned (wrapper type, eval mode, grads, and per parameter the full vs the local element count:
DTensor shards under FSDP2, ``ds_numel`` vs the ``ds_tensor`` partition under DeepSpeed ZeRO-3).
The device memory the ``auto`` decision sees is faked per rank (rank 0: plenty, rank 1: one
byte), so only a decision from the smallest device over all ranks can keep the ranks in step.
Usage: ``torchrun --nproc_per_node=2 frozen_sharding.py REPORT.json A.yaml B.yaml ...``
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from alignkit.config import load_config
from alignkit.distributed import comm
from alignkit.distributed.strategy.base import Strategy
from alignkit.distributed.strategy.deepspeed import DeepSpeedStrategy
from alignkit.distributed.strategy.fsdp import FSDPStrategy
from alignkit.planner import auto
from alignkit.train.runner import run_train

FACTS: list[dict[str, Any]] = []


def local_and_full(p: torch.Tensor) -> tuple[int, int]:
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return p.to_local().numel(), p.numel()
    if hasattr(p, "ds_tensor"):
        return p.ds_tensor.numel(), p.ds_numel
    return p.numel(), p.numel()


def describe(model: nn.Module) -> dict[str, Any]:
    params = list(model.parameters())
    sizes = [local_and_full(p) for p in params]
    biggest = max(range(len(params)), key=lambda i: sizes[i][1])
    local_dtype = getattr(params[biggest], "ds_tensor", params[biggest]).dtype
    return {
        "type": type(model).__name__,
        # a DeepSpeedEngine keeps its own flag; its eval() puts the module it wraps in eval mode
        "training": any(m.training for m in getattr(model, "module", model).modules()),
        "requires_grad": any(p.requires_grad for p in params),
        "local": sum(s[0] for s in sizes),
        "full": sum(s[1] for s in sizes),
        "biggest": list(sizes[biggest]),
        "dtype": str(local_dtype).replace("torch.", ""),
    }


def recording(prepare: Any) -> Any:
    def prepare_frozen(self: Strategy, model: nn.Module) -> nn.Module:
        out = prepare(self, model)
        FACTS.append({**describe(out), "decided": self.shard_frozen})
        return out

    return prepare_frozen


def fake_memory(env: Any) -> auto.DeviceMemory:
    return auto.DeviceMemory("cpu", 10**15 if env.rank == 0 else 1, "fake")


def main(report: str, paths: list[str]) -> None:
    FSDPStrategy.prepare_frozen = recording(FSDPStrategy.prepare_frozen)  # type: ignore[method-assign]
    DeepSpeedStrategy.prepare_frozen = recording(DeepSpeedStrategy.prepare_frozen)  # type: ignore[method-assign]
    auto.probe_device_memory = fake_memory  # type: ignore[assignment]
    out: dict[str, list[list[dict[str, Any]]]] = {}
    for path in paths:
        cfg = load_config(path)
        FACTS.clear()
        run_train(cfg)
        out[Path(cfg.output_dir).name] = comm.all_gather_object(list(FACTS))  # [rank][call]
        dist.barrier()
    if comm.rank() == 0:
        Path(report).write_text(json.dumps(out, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
