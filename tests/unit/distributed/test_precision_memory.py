"""Gradient checkpointing, use_cache=False and the automatic dtype choice, in one process."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from alignkit.algorithms.sft import SFT
from alignkit.config.loader import apply_overrides, build_dataclass
from alignkit.config.schema import RunConfig
from alignkit.distributed.env import DistEnv
from alignkit.distributed.strategy.base import pick_compute_dtype
from alignkit.distributed.strategy.single import SingleStrategy
from alignkit.distributed.strategy.base import Handle
from alignkit.models.loading import load_tokenizer
from alignkit.models.roles import Models, build_model


def build_policy(algo: Any, dtype: torch.dtype) -> torch.nn.Module:
    """The algorithm's first trainable role, built as the runner builds it."""
    spec = algo.model_specs(algo.cfg)[0]
    return build_model(spec, algo.cfg.model, dtype, algo.tokenizer)


def bundle(model: torch.nn.Module, role: str = "policy") -> Models:
    return Models({role: Handle(role, model, None)})  # type: ignore[arg-type]


def make(sft_config: dict[str, Any], *overrides: str) -> tuple[RunConfig, SFT]:
    cfg = build_dataclass(RunConfig, apply_overrides(copy.deepcopy(sft_config), list(overrides)))
    return cfg, SFT(cfg, load_tokenizer(cfg.model))


def loss_and_grads(algo: SFT, strategy: SingleStrategy | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = build_policy(algo, torch.float32)
    model.train()
    batch = algo.data.collate(algo.data.build_dataset(algo.cfg.data.train, "train")[:4])
    ctx = strategy.autocast() if strategy else torch.autocast("cpu", enabled=False)
    with ctx:
        loss, _ = algo.loss(bundle(model), batch, normalizer=float(algo.data.loss_units(batch)))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_same_loss_and_grads(sft_config: dict[str, Any]) -> None:
    _, plain = make(sft_config)
    cfg, ckpt = make(sft_config, "model.gradient_checkpointing=true")
    model = build_policy(ckpt, torch.float32)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.hf_model.modules())
    assert model.hf_model.config.use_cache is False
    l1, g1 = loss_and_grads(plain)
    l2, g2 = loss_and_grads(ckpt)
    assert l1 == pytest.approx(l2, abs=1e-6)
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], atol=1e-6, rtol=1e-5)


def test_auto_dtype_is_fp32_on_cpu() -> None:
    assert pick_compute_dtype("auto", torch.device("cpu")) == torch.float32
    assert pick_compute_dtype("bf16", torch.device("cpu")) == torch.bfloat16


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_autocast_trains_on_cpu(sft_config: dict[str, Any], dtype: str) -> None:
    """bf16 / fp16 (with a grad scaler) autocast run on CPU and stay close to fp32."""
    cfg, algo = make(sft_config, f"model.dtype={dtype}")
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr=None, master_port=None)
    strategy = SingleStrategy(cfg.distributed, env, cfg.model.dtype)
    assert (strategy.new_scaler() is not None) == (dtype == "fp16")
    l_low, g_low = loss_and_grads(algo, strategy)
    _, ref = make(sft_config)
    l_ref, _ = loss_and_grads(ref)
    assert torch.isfinite(torch.tensor(l_low))
    assert l_low == pytest.approx(l_ref, rel=0.05)
    assert all(torch.isfinite(g).all() for g in g_low.values())


def test_lora_base_held_in_compute_dtype_adapters_fp32(sft_config: dict[str, Any], micro_model: Path) -> None:
    """A LoRA policy's frozen base is loaded in the compute dtype (bf16 here), its adapters (and a
    reward model's score head) in fp32; a bf16 autocast step gives fp32 grads on the adapters only."""
    from alignkit.algorithms.reward import RewardModel

    cfg, algo = make(sft_config, "model.dtype=bf16", "model.lora={r: 4, alpha: 8, dropout: 0.0}")
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, master_addr=None, master_port=None)
    strategy = SingleStrategy(cfg.distributed, env, cfg.model.dtype)
    assert strategy.policy_dtype(lora=True) == torch.bfloat16 and strategy.policy_dtype(lora=False) == torch.float32
    model = build_policy(algo, strategy.policy_dtype(lora=True))
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    trainable = {p.dtype for p in model.parameters() if p.requires_grad}
    assert frozen == {torch.bfloat16} and trainable == {torch.float32}
    batch = algo.data.collate(algo.data.build_dataset(cfg.data.train, "train")[:4])
    with strategy.autocast():
        loss, _ = algo.loss(bundle(model), batch, normalizer=float(algo.data.loss_units(batch)))
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)

    rm_cfg = build_dataclass(RunConfig, apply_overrides(copy.deepcopy(sft_config), [
        "algorithm=reward_model", "model.dtype=bf16", "model.lora={r: 4, alpha: 8, dropout: 0.0}"]))
    rm = build_policy(RewardModel(rm_cfg, load_tokenizer(rm_cfg.model)), torch.bfloat16)
    head = [p for n, p in rm.named_parameters() if "score" in n and p.requires_grad]
    assert head and all(p.dtype == torch.float32 for p in head)
    assert {p.dtype for p in rm.parameters() if not p.requires_grad} == {torch.bfloat16}
