"""Helpers the engine tests share: derive a run config, read a run's metrics and final weights."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file


def derive_config(base: dict[str, Any], out: Path, **over: Any) -> dict[str, Any]:
    """A copy of ``base`` writing to ``out``; ``section__key=value`` sets a nested key."""
    c = copy.deepcopy(base)
    c["output_dir"] = str(out)
    for dotted, value in over.items():
        node = c
        *parents, last = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return c


def metric(run: Path, key: str) -> list[float]:
    """Every logged value of ``key`` in the run's metrics.jsonl, in order."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]


def max_delta(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final" / "model.safetensors"))
