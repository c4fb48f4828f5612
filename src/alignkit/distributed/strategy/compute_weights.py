"""bf16 compute weights for the engines that hold whole models (single device, DDP): FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` semantics without sharding.

The optimizer steps fp32 **master** weights (a copy of the model the handle keeps as ``Handle.master``); the
forward and backward run a bf16 **compute** copy (``Handle.module``), so no matmul casts its weight per
micro-batch the way autocast over fp32 weights does (autocast's weight cache lives one forward), and the residual
stream and norms run in bf16 as a bf16 Hugging Face model runs them. Autocast stays on around the forward, so the
ops it keeps in fp32 (log-softmax, the losses) still compute in fp32; with bf16 weights it casts no weight.

Per optimizer step:

* after each micro-batch's backward, the bf16 gradients are added into the fp32 master gradients in ONE foreach op
  (:func:`accumulate_grads`) and dropped, so accumulation over micro-batches is in fp32;
* DDP all-reduces the fp32 master gradients (``reduce_dtype=fp32``) in buckets that start while the last
  micro-batch's backward runs, as DDP's own buckets do (``cast_reduce.py``);
* clipping and the optimizer see only the master weights;
* after the update the compute copy is refreshed from the masters with ONE ``torch._foreach_copy_``
  (:func:`refresh_compute`): one cast of every weight per optimizer step.

Checkpoints hold the master weights (the strategy saves and loads ``Handle.weights``), never the bf16 copy.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from alignkit.models.handle import Handle


def eligible(model: nn.Module, compute_dtype: torch.dtype, setting: str) -> bool:
    """Whether ``model`` trains with compute weights under ``model.compute_weights`` = ``setting``: bf16 runs of a
    model whose every parameter trains (full fine-tuning); a LoRA policy (a frozen bf16 base with fp32 adapters)
    and fp16 (which needs a loss scaler over the weights it steps) keep autocast."""
    if setting == "autocast" or compute_dtype != torch.bfloat16:
        return False
    params = list(model.parameters())
    return bool(params) and all(p.requires_grad for p in params)


def split(model: nn.Module, compute_dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    """(master, compute): ``model`` itself holds the fp32 masters; the compute copy is a deep copy in
    ``compute_dtype`` (the same structure, so both list their parameters in the same order, ties included)."""
    compute = copy.deepcopy(model).to(compute_dtype)
    for source, twin in zip(model.modules(), compute.modules()):
        # a block compiled in place (training.torch_compile: Module.compile) keeps a compiled function bound to the
        # ORIGINAL module, which deepcopy shares: compile the copy's own, as compile_decoder_blocks does
        if getattr(source, "_compiled_call_impl", None) is not None:
            twin._compiled_call_impl = None
            twin.compile(dynamic=getattr(source, "compile_dynamic", True))
    return model, compute


def pairs(handle: Handle) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(master parameters, compute parameters) of ``handle``, in the same order."""
    assert handle.master is not None
    return list(handle.master.parameters()), list(handle.module.parameters())


def accumulate_grads(handle: Handle) -> None:
    """master.grad += compute.grad (fp32 += bf16) for every parameter that got a gradient, as one foreach op; the
    compute gradients are dropped. A master gradient is created (zeros, one foreach op) at the first micro-batch
    of a step."""
    masters, computes = pairs(handle)
    got = [(m, c.grad) for m, c in zip(masters, computes) if c.grad is not None]
    if not got:
        return
    fresh = [m for m, _ in got if m.grad is None]
    if fresh:
        for m, z in zip(fresh, torch._foreach_mul([m.detach() for m in fresh], 0.0)):
            m.grad = z
    torch._foreach_add_([m.grad for m, _ in got], [g for _, g in got])
    for c in computes:
        c.grad = None


def refresh_compute(handle: Handle) -> None:
    """The compute copy := the master weights (cast to bf16), one ``_foreach_copy_`` of every parameter."""
    masters, computes = pairs(handle)
    with torch.no_grad():
        torch._foreach_copy_(computes, masters)
