"""bf16 compute weights (``model.compute_weights: cast``, distributed/strategy/compute_weights.py) against autocast
over fp32 weights on real SFT runs of the micro model on the CPU:

* the cast and copy ops (``_to_copy`` + ``copy_``) an optimizer step dispatches, counted as
  ``../shared/gpu/opcount.py`` counts them (steps 4-6 of a run without logging windows): at most a third of
  autocast's;
* the loss curve equals autocast's within bf16 round-off, and differs from fp32's (the run did compute in bf16);
* the compute copy is bf16 and the masters, the optimizer's parameters and the saved checkpoint fp32, and a
  resumed run continues exactly as the uninterrupted one.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode

from alignkit.config import load_config
from alignkit.train.runner import run_train
from tests.conftest import write_config

COPIES = ("_to_copy", "copy_")


class CopyCount(TorchDispatchMode):
    """Every aten op by name (``opcount.py``'s method); at each optimizer step :attr:`marks` gets the copy count so
    far and :attr:`weight_marks` the count of casts of a parameter (autocast's per-matmul weight casts)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.weight_casts = 0
        self.marks: list[int] = []
        self.weight_marks: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name == "_to_copy" and isinstance(args[0], torch.nn.Parameter):
            self.weight_casts += 1
        return func(*args, **(kwargs or {}))

    def copies(self) -> int:
        return sum(self.ops[k] for k in COPIES)

    def mark(self, *_: Any) -> None:
        self.marks.append(self.copies())
        self.weight_marks.append(self.weight_casts)


def run(sft_config: dict[str, Any], out: Path, dtype: str, compute_weights: str = "cast",
        count: bool = False, **changes: Any) -> tuple[list[float], CopyCount | None]:
    """The logged loss of every step of an SFT run in ``dtype`` / ``compute_weights``, and its op counter."""
    cfg = dict(sft_config, output_dir=str(out))
    cfg["model"] = dict(cfg["model"], dtype=dtype, compute_weights=compute_weights)
    cfg["logging"] = dict(cfg["logging"], plot=False)
    for section, values in changes.items():
        cfg[section] = dict(cfg.get(section, {}), **values)
    loaded = load_config(write_config(out.with_suffix(".yaml"), cfg))
    counter = CopyCount() if count else None
    if counter is None:
        run_train(loaded)
    else:
        hook = register_optimizer_step_post_hook(counter.mark)
        try:
            with counter:
                run_train(loaded)
        finally:
            hook.remove()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r], counter


def test_cast_weights_dispatch_no_weight_cast_per_micro_batch(sft_config: dict[str, Any], tmp_path: Path) -> None:
    """Steps 4-6 of 6 (2 micro-batches each, no log window between). Measured on the micro model (2 layers):
    copies per step autocast 182, cast 84 (the rest: RMSNorm's fp32 round trip and the loss's fp32 log-softmax
    in every micro-batch, as a bf16 model runs them, plus the batch's host-to-device copies); weight casts per step
    autocast 30 (15 matmul weights x 2 micro-batches: 14 projections and the LM head), cast 0. On the 24-layer
    op-count model of the GPU workload's shape (benchmarks/README.md): autocast 1,743 per step, cast 258."""
    quiet = {"training": {"max_steps": 6, "gradient_accumulation_steps": 2},
             "logging": {"logging_steps": 1000, "report_to": ["jsonl"]}}
    copies, weights, foreach = {}, {}, {}
    for mode in ("autocast", "cast"):
        _, c = run(sft_config, tmp_path / mode, "bf16", mode, count=True, **quiet)
        assert c is not None and len(c.marks) == 6
        copies[mode] = (c.marks[5] - c.marks[2]) / 3
        weights[mode] = (c.weight_marks[5] - c.weight_marks[2]) / 3
        foreach[mode] = c.ops["_foreach_copy_"] / 6
    assert weights["autocast"] >= 2 * 14 and weights["cast"] == 0, weights
    assert foreach["cast"] == 1, foreach  # the one refresh of the bf16 copy per optimizer step
    assert copies["cast"] <= copies["autocast"] / 2, copies


def test_cast_loss_curve_equals_autocasts_within_bf16_round_off(sft_config: dict[str, Any], tmp_path: Path) -> None:
    """8 steps of the tiny task (micro model, lr 1e-3). Measured: losses 6.947 -> 6.353 in all three runs; cast vs
    autocast at most 2.4e-4 relative (step 5), autocast vs fp32 at most 1.7e-4: bf16 round-off. Bound 2e-3."""
    steps = {"training": {"max_steps": 8}}
    fp32, _ = run(sft_config, tmp_path / "fp32", "fp32", **steps)
    autocast, _ = run(sft_config, tmp_path / "autocast", "bf16", "autocast", **steps)
    cast, _ = run(sft_config, tmp_path / "cast", "bf16", "cast", **steps)
    assert len(cast) == len(autocast) == 8
    assert cast == pytest.approx(autocast, rel=2e-3)
    assert cast != autocast and cast != fp32  # it computed in bf16, with its own rounding


def test_the_compute_copy_runs_its_own_weights_fused_and_compiled(micro_model: Path) -> None:
    """The copy's forwards use the copy's bf16 weights where a forward was patched per instance (fused layers: a
    partial over the module) or a block was compiled in place (a compiled function bound to the module)."""
    from transformers import AutoModelForCausalLM

    from alignkit.distributed.strategy.compute_weights import split
    from alignkit.models import fused
    from alignkit.train.runner import compile_decoder_blocks

    model = AutoModelForCausalLM.from_pretrained(str(micro_model))
    assert sum(fused.apply_fused_layers(model).values()) > 0
    compile_decoder_blocks(model)
    master, compute = split(model, torch.bfloat16)
    assert master is model and all(p.dtype == torch.float32 for p in master.parameters())
    assert all(p.dtype == torch.bfloat16 for p in compute.parameters())
    for a, b in zip(master.model.layers, compute.model.layers):
        assert b._compiled_call_impl is not None and b._compiled_call_impl is not a._compiled_call_impl
        assert b.mlp.forward.args[0] is b.mlp and b.input_layernorm.forward.args[0] is b.input_layernorm


@pytest.mark.parametrize("setting,param_dtype", [("cast", torch.bfloat16), ("autocast", None)])
def test_fsdp_mixed_precision_follows_the_setting(setting: str, param_dtype: torch.dtype | None) -> None:
    """FSDP2's own MixedPrecisionPolicy is the cast path (bf16 parameters, fp32 reduce-scatter); autocast turns it
    off, so the forward runs under autocast as on the other engines."""
    from alignkit.config.schema import DistributedConfig
    from alignkit.distributed.env import DistEnv
    from alignkit.distributed.strategy.fsdp import FSDPStrategy

    strategy = FSDPStrategy(DistributedConfig(), DistEnv(0, 1, 0, 1, None, None), "bf16", compute_weights=setting)
    policy = strategy._mp_policy()
    assert policy.param_dtype == param_dtype
    assert policy.reduce_dtype == (torch.float32 if param_dtype else None)
    assert isinstance(strategy.autocast(), torch.autocast) == (param_dtype is None)
