"""Exponential moving average of the trained parameters (``flow_grpo.ema``), as flow_grpo's ``EMAModuleWrapper``
(yifan123/flow_grpo ``flow_grpo/ema.py``, used by ``scripts/train_sd3.py``).

With s the optimizer steps done (flow_grpo's ``global_step``), every ``interval`` steps (when
(s + 1) % interval == 0): ``ema <- ema + (1 - d_s) (param - ema)`` with the warm-up decay
``d_s = min((1 + s) / (10 + s), decay)``. flow_grpo's loop steps its EMA once per training micro-batch with the
count of optimizer steps done so far, so with gradient accumulation n the update at s is applied n times with the
weights of step s (once right after the step, n - 1 times during the next one's accumulation):
:meth:`ParamEMA.after_step` with ``times=n`` does the same after the step.
The copy lives on each rank next to the parameters' local storage (``Strategy.local_params``: whole tensors
under single / DDP / ZeRO-2, this rank's shard under FSDP2 and ZeRO-3), so it is sharded exactly as they are
and the update is elementwise. :meth:`ParamEMA.swapped` puts the averages in place of the parameters for the
duration (evaluation, the final save) and restores the trained values after. Saved per rank, by parameter name.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import Tensor

from alignkit.errors import ModelError


def ema_decay_at(step: int, decay: float) -> float:
    """flow_grpo's warm-up decay ``min((1 + step) / (10 + step), decay)`` after ``step`` optimizer steps."""
    return min((1 + step) / (10 + step), decay)


class ParamEMA:
    """fp32 EMA copies of ``params`` (name -> the local storage of a trained parameter; module docstring)."""

    def __init__(self, params: dict[str, Tensor], *, decay: float, interval: int = 1) -> None:
        self.decay, self.interval = decay, interval
        self.shadow = {n: p.detach().float().clone() for n, p in params.items()}

    def _check(self, params: dict[str, Tensor]) -> None:
        if params.keys() != self.shadow.keys():
            raise ModelError(f"EMA: the trained parameters changed (e.g. {sorted(set(params) ^ set(self.shadow))[:2]})")

    @torch.no_grad()
    def update(self, params: dict[str, Tensor], step: int) -> bool:
        """One EMA step at optimizer-step count ``step``; returns whether it updated the averages."""
        if (step + 1) % self.interval:
            return False
        self._check(params)
        w = 1.0 - ema_decay_at(step, self.decay)
        for n, s in self.shadow.items():
            s.add_(params[n].detach().float() - s, alpha=w)
        return True

    @property
    def first_update(self) -> int:
        """The optimizer-step count of the first update (``after_step``'s ``step``): ``interval - 1``."""
        return self.interval - 1

    def updated_by(self, step: int) -> bool:
        """Whether the averages have moved from the weights they started from after ``step`` optimizer steps (before
        the first update they are those weights: with a fresh LoRA, an adapter of zeros)."""
        return step >= self.first_update

    def after_step(self, params: dict[str, Tensor], step: int, *, times: int = 1) -> bool:
        """After ``step`` optimizer steps: ``times`` EMA steps with these weights (flow_grpo's stepping once per
        micro-batch: ``times`` = its gradient accumulation); whether they updated the averages."""
        return any([self.update(params, step) for _ in range(times)])

    @contextlib.contextmanager
    def swapped(self, params: dict[str, Tensor], refresh: Callable[[], None] = lambda: None) -> Iterator[None]:
        """The averages in the parameters' storage for the duration; the trained values back after. ``refresh``
        runs after each write (``Strategy.refresh_params``: an engine's gathered copies follow the storage)."""
        self._check(params)
        saved = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(self.shadow[n])
        refresh()
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(saved[n])
            refresh()

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        save_file({n: s.contiguous() for n, s in self.shadow.items()}, str(path))

    def load(self, path: Path) -> None:
        from safetensors.torch import load_file

        if not path.is_file():
            raise ModelError(f"{path}: no EMA state for this rank (flow_grpo.ema resumes on the world size and engine "
                             "that wrote it)")
        saved = load_file(str(path))
        if saved.keys() != self.shadow.keys() or any(saved[n].shape != s.shape for n, s in self.shadow.items()):
            raise ModelError(f"{path}: the EMA state does not match this run's trained parameters")
        for n, s in self.shadow.items():
            s.copy_(saved[n])
