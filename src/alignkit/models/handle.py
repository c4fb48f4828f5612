"""A trained model as the Strategy holds it: the record the ``Models`` bundle (``models/roles.py``) keeps per
trainable role. It sits on the models floor, below the engines that make it (``Strategy.prepare`` in
``distributed/strategy/base.py``, which re-exports it), so the bundle names it without importing them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class Handle:
    """One trainable model as the engine holds it.

    ``module`` is what forward calls (the DDP / FSDP module or the DeepSpeed engine); ``engine`` is
    the DeepSpeed engine (None elsewhere); ``scaler`` is this model's fp16 loss scaler (None for
    bf16 / fp32 and for DeepSpeed, which scales itself): one per model, so one role's overflow
    neither skips nor rescales another role's step; ``scheduler`` is set by the loop; ``sync`` is
    False while an accumulation micro-batch that is not the last of the step runs (``Strategy.no_sync``);
    ``master`` holds the fp32 master weights the optimizer steps when ``module`` computes in a bf16 copy of them
    (``model.compute_weights``: ``distributed/strategy/compute_weights.py``), None otherwise.
    """

    role: str
    module: nn.Module
    optimizer: torch.optim.Optimizer
    engine: Any = None
    scaler: torch.amp.GradScaler | None = None
    scheduler: Any = None
    sync: bool = True
    master: nn.Module | None = None

    @property
    def weights(self) -> nn.Module:
        """The module that holds the trained weights (saved, loaded, stepped): the fp32 masters where a bf16
        compute copy runs the forward, else ``module`` itself."""
        return self.module if self.master is None else self.master
