"""Memory-lean training forwards for the Llama family's SwiGLU MLP and RMSNorm (``training.fused_layers``).

Autograd keeps every intermediate an op needs for its backward. For ``down(silu(gate(x)) * up(x))`` that is
four (T, intermediate) tensors per layer: ``gate(x)`` (for silu), ``silu(gate(x))`` and ``up(x)`` (for the
product) and the product itself (for ``down``'s weight gradient). :class:`SwiGLU` keeps two, ``gate(x)`` and
``up(x)``, and recomputes the other two (two element-wise ops) in its backward; the GEMMs are the same. For
the Llama RMSNorm, autograd keeps the input, the normalised input and 1/rms; :class:`RMSNorm` keeps the input
and 1/rms. Same math, same GEMMs; gradients equal to autograd's to round-off (tests/unit/models/test_fused_layers.py).

Applied per module instance (``module.forward`` replaced, names and state dicts unchanged) to trainable models
under the single, ddp and fsdp strategies only: DeepSpeed ZeRO-3 gathers each ``nn.Linear``'s parameters in
that module's own forward hook, which a fused forward would skip. A module whose projections are not plain
bias-free ``nn.Linear`` (LoRA-wrapped, quantised) or whose activation is not SiLU keeps its own forward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(torch.autograd.Function):
    """``down(silu(x @ Wg^T) * (x @ Wu^T))``, saving x, gate(x) and up(x) for the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
        g = F.linear(x, wg)
        u = F.linear(x, wu)
        # x only for the gate/up weight gradients (frozen projections, e.g. LoRA elsewhere, need none)
        ctx.save_for_backward(x if wg.requires_grad or wu.requires_grad else None, wg, wu, wd, g, u)
        return F.linear(F.silu(g) * u, wd)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, wg, wu, wd, g, u = ctx.saved_tensors
        need_x, need_wg, need_wu, need_wd = ctx.needs_input_grad
        s = F.silu(g)
        dh = dy @ wd
        dwd = dy.reshape(-1, dy.shape[-1]).t() @ (s * u).reshape(-1, u.shape[-1]) if need_wd else None
        du = dh * s
        del s
        dg = torch.ops.aten.silu_backward(dh * u, g)
        del dh
        dwg = dg.reshape(-1, dg.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) if need_wg else None
        dwu = du.reshape(-1, du.shape[-1]).t() @ x.reshape(-1, x.shape[-1]) if need_wu else None
        dx = torch.addmm(du.reshape(-1, du.shape[-1]) @ wu, dg.reshape(-1, dg.shape[-1]), wg).reshape(
            *dy.shape[:-1], wg.shape[1]) if need_x else None
        return dx, dwg, dwu, dwd


class RMSNorm(torch.autograd.Function):
    """``w * (x / rms(x))`` computed in fp32 as transformers' LlamaRMSNorm does, saving x (in its own dtype, where
    autograd keeps the fp32 upcast) and 1/rms."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, w, r)
        return w * (x32 * r).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, r = ctx.saved_tensors
        need_x, need_w, _ = ctx.needs_input_grad
        n32 = x.float() * r
        dw = (dy * n32.to(x.dtype)).reshape(-1, w.shape[-1]).sum(0).to(w.dtype) if need_w else None
        dx = None
        if need_x:
            dn = (dy * w).to(x.dtype).float()
            dx = (r * (dn - n32 * (dn * n32).mean(-1, keepdim=True))).to(x.dtype)
        return dx, dw, None


def _mlp_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return SwiGLU.apply(x, module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight)


def _rmsnorm_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return RMSNorm.apply(x, module.weight, module.variance_epsilon)


def _plain_linear(m: Any) -> bool:
    return type(m) is nn.Linear and m.bias is None


def fusable_mlp(module: nn.Module) -> bool:
    """A Llama-family SwiGLU MLP: plain bias-free gate/up/down projections and a SiLU activation."""
    act = getattr(module, "act_fn", None)
    return (all(_plain_linear(getattr(module, p, None)) for p in ("gate_proj", "up_proj", "down_proj"))
            and (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"))


#: RMSNorm classes whose forward is exactly LlamaRMSNorm's (checked by tests/unit/models/test_fused_layers.py)
_LLAMA_STYLE_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


def fusable_rmsnorm(module: nn.Module) -> bool:
    """transformers' Llama-style RMSNorm (``weight * x / rms(x)``, not Gemma's ``1 + weight``)."""
    return (type(module).__name__ in _LLAMA_STYLE_NORMS and isinstance(getattr(module, "weight", None), nn.Parameter)
            and isinstance(getattr(module, "variance_epsilon", None), float))


#: engines under which fused (and compiled) forwards apply: DeepSpeed ZeRO-3 gathers each linear's parameters in
#: that module's own forward hook, which they would bypass
STRATEGIES = ("single", "ddp", "fsdp")


def fused_layers_on(enabled: bool, strategy: str) -> bool:
    """Whether ``training.fused_layers`` (``enabled``) applies under ``strategy`` (a resolved name or ``auto``, which
    the estimator counts unfused: it may pick deepspeed)."""
    return enabled and strategy in STRATEGIES


def apply_fused_layers(model: nn.Module) -> dict[str, int]:
    """Replace the forward of every fusable MLP and RMSNorm instance in ``model``; returns the counts."""
    counts = {"mlp": 0, "rmsnorm": 0}
    for module in model.modules():
        if fusable_mlp(module):
            module.forward = functools.partial(_mlp_forward, module)  # type: ignore[method-assign]
            counts["mlp"] += 1
        elif fusable_rmsnorm(module):
            module.forward = functools.partial(_rmsnorm_forward, module)  # type: ignore[method-assign]
            counts["rmsnorm"] += 1
    return counts
