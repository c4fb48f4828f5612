"""Helpers shared by the sharding engines (FSDP2, DeepSpeed): process group for one process,
finding the decoder blocks to shard, and writing a gathered state dict in Hugging Face format."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from alignkit.models.loading import hf_model


def ensure_process_group(backend: str, timeout_minutes: float) -> None:
    """A one-rank process group when no launcher made one: FSDP2 and DeepSpeed always need
    collectives (e.g. FSDP2 with CPU offload on a single GPU). An in-memory store, no ports."""
    if not dist.is_initialized():
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(minutes=timeout_minutes)
        )


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks inside ``model`` (each becomes one FSDP unit).

    Found by the class names HF models list in ``_no_split_modules`` (e.g. ``LlamaDecoderLayer``),
    which also covers a peft-wrapped model (``base_model.model.model.layers``) and VLM vision
    towers; else the children of the first ``ModuleList`` named ``layers``/``h``/``blocks``.
    """
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if blocks:
        return blocks
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks"):
            return list(m)
    return []


def inner_prefix(model: nn.Module) -> str:
    """Key prefix of the HF model inside our wrapper, e.g. ``"hf_model."`` for CausalLMLogps."""
    inner = hf_model(model)
    for name, m in model.named_modules():
        if m is inner:
            return f"{name}." if name else ""
    raise ValueError(f"{type(model).__name__}: cannot locate the Hugging Face model inside it")


def save_hf_state_dict(
    model: nn.Module, state_dict: dict[str, torch.Tensor], out_dir: Path, tokenizer: Any = None
) -> None:
    """Write a full state dict of the training module (rank 0) with the inner model's
    ``save_pretrained``, so ``from_pretrained`` (or ``PeftModel.from_pretrained``, which keeps
    only the adapter keys) loads it like any Hugging Face checkpoint."""
    prefix = inner_prefix(model)
    sd = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    inner = hf_model(model)
    inner.save_pretrained(str(out_dir), state_dict=sd, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
