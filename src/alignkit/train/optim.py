"""AdamW with decay only on matrices, and the warmup + decay schedule in optimizer steps."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from alignkit.config.schema import TrainingConfig


#: strategies whose optimizer sees plain, unflattened parameters: fused AdamW applies there
FUSED_STRATEGIES = ("single", "ddp")


def optimizer_impl(t: TrainingConfig, strategy: str) -> str:
    """``training.optimizer_impl`` resolved for ``strategy``: ``auto`` = fused where the optimizer sees the
    model's own parameters (single, ddp), foreach where an engine shards (FSDP2's DTensors) or flattens
    (DeepSpeed's partitions) them."""
    if t.optimizer_impl != "auto":
        return t.optimizer_impl
    return "fused" if strategy in FUSED_STRATEGIES else "foreach"


def build_optimizer(model: nn.Module, t: TrainingConfig, lr: float, *, impl: str = "foreach") -> torch.optim.Optimizer:
    """torch AdamW over ``model``'s trainable parameters; ``impl`` is fused, foreach or for_loop (the same
    update to round-off: tests/unit/train/test_optim.py)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        # biases and norm weights (1-D) are not decayed, as is standard for transformers
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}[impl]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_epsilon, **flags)
    if impl == "fused":
        optimizer.register_step_post_hook(_mark_written)
    return optimizer


def _mark_written(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Bump the in-place version counter of every parameter the step wrote. torch's fused AdamW kernel writes
    the weights through their data pointers without bumping it (foreach and for_loop do): whatever tells "the
    weights changed" from ``param._version`` (the vLLM engine's weight sync, autograd's check on tensors saved
    for backward) would otherwise miss the step."""
    torch.autograd.graph.increment_version([p for g in optimizer.param_groups for p in g["params"]])


def warmup_steps(t: TrainingConfig, total_steps: int) -> int:
    return t.warmup_steps if t.warmup_steps > 0 else int(math.ceil(t.warmup_ratio * total_steps))


def lr_factor(step: int, *, kind: str, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    if kind == "linear":
        decay = 1.0 - progress
    else:  # cosine
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay


def build_scheduler(optimizer: torch.optim.Optimizer, t: TrainingConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    w = warmup_steps(t, total_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_factor(s, kind=t.lr_scheduler, warmup=w, total=total_steps, min_ratio=t.min_lr_ratio),
    )
