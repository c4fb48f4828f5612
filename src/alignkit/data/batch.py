"""The batch contract: a micro-batch keeps the model's inputs apart from the algorithm's own fields.

A :class:`Batch` reads like a dict of tensors (``batch["targets"]``, ``batch.get("ref_logps")``), but
only the keys a collator DECLARED as model inputs (``input_ids``, ``attention_mask``, ``position_ids``,
``pixel_values``, ...) go into a model's forward (:meth:`Batch.model_inputs`). Everything an algorithm
adds afterwards (``advantages``, ``cost_returns``, cached scores, labels) is a field by default: a new
field can never reach a Hugging Face ``forward`` as an unexpected keyword argument by accident.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from alignkit.constants import IGNORE_INDEX


class Batch(dict):
    """A micro-batch: every tensor by name; :attr:`input_keys` are the model's inputs among them."""

    def __init__(self, inputs: Mapping[str, Any] | None = None, fields: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.input_keys: set[str] = set()
        self.add_inputs(inputs or {})
        self.update(fields or {})

    def add_inputs(self, inputs: Mapping[str, Any]) -> "Batch":
        """Declare and set model inputs (e.g. a VLM's ``pixel_values``, ``image_sizes``)."""
        for k, v in inputs.items():
            self[k] = v
            self.input_keys.add(k)
        return self

    def model_inputs(self) -> dict[str, Any]:
        """The declared model inputs (None-valued ones left out): what a forward receives."""
        return {k: self[k] for k in self.input_keys if k in self and self[k] is not None}

    def fields(self) -> dict[str, Any]:
        """The algorithm's own fields (targets, indices, labels, cached values, advantages, ...)."""
        return {k: v for k, v in self.items() if k not in self.input_keys}

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self.input_keys.discard(key)

    def pop(self, key: str, *default: Any) -> Any:  # type: ignore[override]
        self.input_keys.discard(key)
        return super().pop(key, *default)

    def map(self, fn: Any) -> "Batch":
        """A new batch with ``fn`` applied to every tensor (e.g. moved to a device), the split kept."""
        out = Batch()
        for k, v in self.items():
            super(Batch, out).__setitem__(k, fn(v) if isinstance(v, torch.Tensor) else v)
        out.input_keys = set(self.input_keys)
        return out

    def to(self, device: torch.device) -> "Batch":
        """The batch on ``device``; a batch leaving the host first adds the flat positions of its targets
        (``target_index``, a field), which the host computes at no cost and the device could only find with
        a boolean mask, i.e. a sync (:func:`select_targets`)."""
        targets = self.get("targets")
        if isinstance(targets, torch.Tensor) and targets.device.type == "cpu" and "target_index" not in self:
            self["target_index"] = (targets.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)
        return self.map(lambda t: t.to(device, non_blocking=True))

    def __reduce__(self) -> Any:  # DataLoader workers pickle batches: keep the split
        return (_rebuild, ({k: self[k] for k in self.input_keys if k in self}, self.fields()))


def _rebuild(inputs: dict[str, Any], fields: dict[str, Any]) -> Batch:
    return Batch(inputs, fields)


def model_inputs(batch: Batch) -> dict[str, Any]:
    """What goes into a model's forward: the batch's declared inputs. A plain dict is refused, since it
    cannot say which of its keys are inputs."""
    if not isinstance(batch, Batch):
        raise TypeError(f"model_inputs needs an alignkit Batch (inputs declared apart from fields), got "
                        f"{type(batch).__name__} with keys {sorted(batch)}")
    return batch.model_inputs()



def select_targets(x: torch.Tensor, targets: torch.Tensor, target_index: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``(B, T, ...)`` at the positions whose target is not IGNORE_INDEX, ``(N, ...)`` in row-major order:
    an ``index_select`` of the host-computed ``target_index`` (:meth:`Batch.to`) when there is one; else a
    boolean mask, whose size only the device knows (a host sync: for batches that never left the host)."""
    if target_index is None:
        return x[targets != IGNORE_INDEX]
    return x.reshape(-1, *x.shape[2:]).index_select(0, target_index)


def at_targets(batch: Batch | dict[str, Any], x: torch.Tensor) -> torch.Tensor:
    """:func:`select_targets` with the batch's own targets and target index."""
    return select_targets(x, batch["targets"], batch.get("target_index"))
