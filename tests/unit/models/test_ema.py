"""models/ema.py: flow_grpo's EMAModuleWrapper rule (warm-up decay, update interval), the swap for evaluation and
saving, and the per-rank file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from alignkit.errors import ModelError
from alignkit.models.ema import ParamEMA, ema_decay_at


def test_warm_up_decay_is_flow_grpos() -> None:
    assert ema_decay_at(0, 0.9) == pytest.approx(0.1)  # (1 + 0) / (10 + 0)
    assert ema_decay_at(5, 0.9) == pytest.approx(6 / 15)
    assert ema_decay_at(80, 0.9) == 0.9  # 81 / 90 = 0.9, and capped from there on
    assert ema_decay_at(1000, 0.9) == 0.9


def test_update_rule_by_hand_every_interval_steps() -> None:
    p = {"w": torch.tensor([1.0, 2.0])}
    ema = ParamEMA(p, decay=0.5, interval=2)
    p["w"].copy_(torch.tensor([3.0, 0.0]))
    assert not ema.update(p, 0)  # (0 + 1) % 2 != 0: no update
    assert torch.equal(ema.shadow["w"], torch.tensor([1.0, 2.0]))
    assert ema.update(p, 1)  # d = min(2 / 11, 0.5): ema + (9 / 11) (p - ema)
    expected = torch.tensor([1.0 + 9 / 11 * 2.0, 2.0 - 9 / 11 * 2.0])
    assert torch.allclose(ema.shadow["w"], expected)
    p["w"].copy_(torch.tensor([0.0, 0.0]))
    assert ema.update(p, 29)  # d = min(30 / 39, 0.5) = 0.5
    assert torch.allclose(ema.shadow["w"], expected / 2)


def test_swapped_puts_the_averages_in_place_and_restores_the_trained_values(tmp_path: Path) -> None:
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    ema = ParamEMA({"w": w.data}, decay=0.9)
    with torch.no_grad():
        w.add_(1.0)
    ema.update({"w": w.data}, 0)  # 1 + 0.9 x 1 = 1.9, 2.9
    with ema.swapped({"w": w.data}):
        assert torch.allclose(w.detach(), torch.tensor([1.9, 2.9]))
    assert torch.equal(w.detach(), torch.tensor([2.0, 3.0]))
    path = tmp_path / "ema_rank0.safetensors"
    ema.save(path)
    other = ParamEMA({"w": torch.zeros(2)}, decay=0.9)
    other.load(path)
    assert torch.equal(other.shadow["w"], ema.shadow["w"])
    with pytest.raises(ModelError, match="does not match"):
        ParamEMA({"v": torch.zeros(2)}, decay=0.9).load(path)
    with pytest.raises(ModelError, match="no EMA state for this rank"):
        other.load(tmp_path / "ema_rank1.safetensors")
