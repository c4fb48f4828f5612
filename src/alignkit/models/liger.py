"""Liger-Kernel's fused linear cross-entropy as the SFT head loss (``training.liger_kernel: true``).

Liger computes the LM head and the cross-entropy chunk by chunk in Triton kernels and, for a summed loss,
the gradients of the hidden states and the head weight already in forward (backward only scales them):
no ``(N, V)`` logits and no recompute. It is CUDA-only (Triton) and an optional extra
(``pip install 'alignkit[liger]'``), so :func:`check_liger` refuses it, in one line and before any model
loads, where it cannot run. The built-in path (:func:`alignkit.ops.logprobs.chunked_token_logps`) computes
the same sum to round-off.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch
from torch import Tensor

from alignkit.errors import ConfigError
from alignkit.models.loading import hf_model

#: algorithms whose loss is a plain sum of token NLLs, the one reduction Liger's fused kernel serves
LIGER_ALGORITHMS = ("sft",)


def liger_installed() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def check_liger(algorithm: str, device: torch.device) -> None:
    """Raise a one-line :class:`ConfigError` where ``training.liger_kernel: true`` cannot run: an algorithm
    other than SFT, a device other than CUDA, or liger-kernel not installed."""
    if algorithm not in LIGER_ALGORITHMS:
        raise ConfigError(f"training.liger_kernel: fused linear cross-entropy serves the {', '.join(LIGER_ALGORITHMS)} "
                          f"loss only, not {algorithm}; set training.liger_kernel: false")
    _check_runs("training.liger_kernel", device)


def _check_runs(key: str, device: torch.device) -> None:
    """Raise a one-line :class:`ConfigError` naming ``key`` where Liger cannot run: off CUDA, or not installed."""
    if device.type != "cuda":
        raise ConfigError(f"{key}: Liger-Kernel is Triton and needs a CUDA GPU (this run's device is "
                          f"{device.type}); set {key}: false")
    if not liger_installed():
        raise ConfigError(f"{key}: liger-kernel is not installed: pip install 'alignkit[liger]' "
                          f"(or liger-kernel), or set {key}: false")


def liger_nll_sum(hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Tensor | None = None) -> Tensor:
    """``sum_i -log softmax(hidden_i @ weight.T + bias)[targets_i]`` through Liger's fused kernel, float32.

    hidden: ``(N, H)``; weight: ``(V, H)``; targets: ``(N,)`` ids in ``[0, V)`` (rows to ignore are left out
    by the caller). Under autocast both operands are cast to the autocast dtype first, as ``nn.Linear``
    would be (no float32 GEMM under bf16); the weight gradient accumulates in float32.
    """
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    if hidden.shape[0] == 0:  # nothing to score: a zero that keeps both in the graph
        return (hidden.sum() + weight.sum()).float() * 0.0
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    loss = LigerFusedLinearCrossEntropyLoss(reduction="sum", accum_dtype=torch.float32)
    return loss(weight, hidden.contiguous(), targets, bias).float()


# --------------------------------------------------------------------------- training.liger_layers
#: model_type -> Liger-Kernel's own patch function for it (liger_kernel.transformers), which swaps the decoder's
#: RMSNorm and SwiGLU MLP forwards of a loaded model and the modeling module's RoPE function
LIGER_LAYER_PATCHES = {"llama": "apply_liger_kernel_to_llama", "qwen2": "apply_liger_kernel_to_qwen2"}


def check_liger_layers(device: torch.device, fused_layers: bool) -> None:
    """Raise a one-line :class:`ConfigError` where ``training.liger_layers: true`` cannot run: beside
    ``training.fused_layers`` (both replace the MLP and RMSNorm forwards), off CUDA, or liger-kernel missing."""
    if fused_layers:
        raise ConfigError("training.liger_layers: Liger's RMSNorm and SwiGLU replace the same forwards as "
                          "training.fused_layers; set one of them to false")
    _check_runs("training.liger_layers", device)


def apply_liger_layers(model: torch.nn.Module) -> str:
    """Liger's RMSNorm, SwiGLU MLP and RoPE in ``model`` (an alignkit wrapper, a peft model or a Hugging Face
    model) through Liger's own ``apply_liger_kernel_to_<type>(model=...)``; the LM head and the losses stay
    alignkit's (no Liger cross-entropy: ``training.liger_kernel`` is the fused head). The RoPE patch is
    module-wide in transformers (every model of that type in the process). Returns the model type."""
    inner = hf_model(model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # peft: the wrapped model
    model_type = getattr(getattr(inner, "config", None), "model_type", None)
    if model_type not in LIGER_LAYER_PATCHES:
        raise ConfigError(f"training.liger_layers: Liger's layer kernels are wired for "
                          f"{', '.join(LIGER_LAYER_PATCHES)} models, not {model_type}; set training.liger_layers: false")
    patch = getattr(importlib.import_module("liger_kernel.transformers"), LIGER_LAYER_PATCHES[model_type])
    patch(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False, model=inner)
    return model_type
