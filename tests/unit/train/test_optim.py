"""training.optimizer_impl: fused, foreach and for_loop AdamW make the same update; auto's choice per engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from alignkit.config.schema import TrainingConfig
from alignkit.train.optim import build_optimizer, optimizer_impl


def _train(impl: str, steps: int = 6) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 8))
    t = TrainingConfig(weight_decay=0.1, adam_beta2=0.99)
    opt = build_optimizer(model, t, 1e-2, impl=impl)
    data = torch.randn(steps, 12, 16, generator=torch.Generator().manual_seed(1))
    for x in data:
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def test_fused_and_for_loop_equal_foreach_after_steps() -> None:
    ref = _train("foreach")
    for impl in ("fused", "for_loop"):
        got = _train(impl)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the steps moved the weights (the comparison is not between untouched copies)
    torch.manual_seed(0)
    init = [p.detach() for p in nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 8)).parameters()]
    assert max((a - b).abs().max().item() for a, b in zip(ref, init)) > 1e-2


def test_build_optimizer_sets_the_implementation_and_decay_groups() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    t = TrainingConfig(weight_decay=0.1)
    for impl, (fused, foreach) in {"fused": (True, None), "foreach": (None, True), "for_loop": (None, False)}.items():
        opt = build_optimizer(model, t, 1e-3, impl=impl)
        group = opt.param_groups[0]
        assert (group["fused"], group["foreach"]) == (fused, foreach), impl
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
        assert [len(g["params"]) for g in opt.param_groups] == [1, 3]  # the matrix; bias, norm weight, norm bias


@pytest.mark.parametrize("strategy,expected", [("single", "fused"), ("ddp", "fused"), ("fsdp", "foreach"),
                                               ("deepspeed", "foreach")])
def test_auto_picks_fused_where_parameters_are_plain(strategy: str, expected: str) -> None:
    assert optimizer_impl(TrainingConfig(), strategy) == expected
    assert optimizer_impl(TrainingConfig(optimizer_impl="for_loop"), strategy) == "for_loop"


def test_fused_step_marks_the_parameters_written() -> None:
    """torch's fused AdamW writes through data pointers without bumping ``_version``; build_optimizer bumps it,
    as foreach does, so version-based checks (the vLLM engine's weight sync) see every step."""
    for impl in ("fused", "foreach", "for_loop"):
        model = nn.Linear(4, 4)
        opt = build_optimizer(model, TrainingConfig(), 1e-2, impl=impl)
        before = [p._version for p in model.parameters()]
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        assert all(p._version > v for p, v in zip(model.parameters(), before)), impl


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_sft_run_with_fused_equals_foreach(sft_config: dict[str, Any], tmp_path: Path) -> None:
    """The whole training path (clipping, schedule, packed batches) with either implementation."""
    from alignkit.config.loader import load_config
    from alignkit.train.runner import run_train

    from tests.conftest import write_config

    losses = {}
    for impl in ("fused", "foreach"):
        cfg = dict(sft_config, output_dir=str(tmp_path / impl))
        cfg["training"] = dict(cfg["training"], optimizer_impl=impl, max_steps=5, max_grad_norm=0.5)
        run_train(load_config(write_config(tmp_path / f"{impl}.yaml", cfg)))
        losses[impl] = _losses(tmp_path / impl)
    assert len(losses["fused"]) == 5
    assert losses["fused"][-1] < losses["fused"][0]
    assert losses["fused"] == pytest.approx(losses["foreach"], rel=1e-5)


@pytest.mark.slow(seconds=60)
def test_torch_compile_trains_to_the_same_losses(sft_config: dict[str, Any], tmp_path: Path) -> None:
    """training.torch_compile compiles the decoder blocks (packed rows, varying lengths: dynamic shapes) and
    gives the eager run's losses; the saved weights keep their names."""
    from alignkit.config.loader import load_config
    from alignkit.train.runner import run_train

    from tests.conftest import write_config

    losses = {}
    for on in (True, False):
        cfg = dict(sft_config, output_dir=str(tmp_path / str(on)), checkpoint={"save_final": on})
        cfg["data"] = dict(cfg["data"], packing=True)
        cfg["training"] = dict(cfg["training"], torch_compile=on, max_steps=4)
        run_train(load_config(write_config(tmp_path / f"{on}.yaml", cfg)))
        losses[on] = _losses(tmp_path / str(on))
    assert len(losses[True]) == 4 and losses[True][-1] < losses[True][0]
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)
    saved = (tmp_path / "True" / "final" / "model.safetensors")
    from safetensors import safe_open

    with safe_open(str(saved), "pt") as f:
        assert not [k for k in f.keys() if "_orig_mod" in k]


def test_torch_compile_is_refused_under_deepspeed(sft_config: dict[str, Any], tmp_path: Path) -> None:
    from types import SimpleNamespace

    from alignkit.config.loader import load_config
    from alignkit.errors import ConfigError
    from alignkit.train.runner import COMPILE_STRATEGIES, Session

    from tests.conftest import write_config

    assert "deepspeed" not in COMPILE_STRATEGIES
    cfg = dict(sft_config, training=dict(sft_config["training"], torch_compile=True))
    session = Session(cfg=load_config(write_config(tmp_path / "c.yaml", cfg)), env=None, algo=None, workload=None,
                      plan=SimpleNamespace(strategy="deepspeed"), strategy=None, preflight={})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="training.torch_compile: supported under the single, ddp, fsdp"):
        session.build_models()
