"""LoRA adapters: loading an adapter directory onto its base, switching adapters off, merging
(``models/adapter_dirs.py`` recognises the directories).
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from alignkit.errors import ConfigError
from alignkit.models.adapter_dirs import ADAPTER_CONFIG, adapter_base, adapter_config, is_adapter_dir
from alignkit.models.loading import load_causal_lm, quiet_load_report, quiet_peft, upcast_trainable


def attach_adapter(base_model: nn.Module, path: str | Path, *, trainable: bool) -> nn.Module:
    """``base_model`` with the adapter of ``path`` loaded (a PeftModel)."""
    from peft import PeftModel

    with quiet_peft():
        model = PeftModel.from_pretrained(base_model, str(path), is_trainable=trainable)
    return upcast_trainable(model) if trainable else model


def peft_model_of(model: nn.Module) -> nn.Module | None:
    """The PeftModel inside our wrappers (DDP ``.module``, ``.hf_model``), or None."""
    from peft import PeftModel

    seen = 0
    while model is not None and seen < 8:
        if isinstance(model, PeftModel):
            return model
        model = getattr(model, "module", None) or getattr(model, "hf_model", None)
        seen += 1
    return None


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its LoRA base: peft's ``disable_adapter()`` (no second copy in memory).

    ``model`` may be wrapped (DDP, our log-prob wrapper); the forward must still go through the
    wrapper so that sharded engines gather their parameters.
    """
    owner = peft_model_of(model) or _adapter_owner(model)
    if owner is None:
        raise ConfigError("the reference is the LoRA base (dpo.reference=lora_base) but the model has no LoRA adapters")
    with owner.disable_adapter():
        yield


def _adapter_owner(model: nn.Module) -> nn.Module | None:
    """A module inside our wrappers with a ``disable_adapter()`` context of its own (the diffusion kind's
    :class:`~alignkit.models.diffusion.FlowPolicy`: LoRA injected by diffusers, no PeftModel), or None."""
    for _ in range(8):
        if model is None:
            return None
        if callable(getattr(model, "disable_adapter", None)) and getattr(model, "lora", False):
            return model
        model = getattr(model, "module", None)
    return None


def merge_lora(adapter_dir: str | Path, out_dir: str | Path, *, base: str | None = None) -> Path:
    """Load base + adapter, ``merge_and_unload`` and save a plain Hugging Face model (+ tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    adapter_dir, out = Path(adapter_dir), Path(out_dir)
    if not is_adapter_dir(adapter_dir):
        raise FileNotFoundError(f"{adapter_dir}: not a LoRA adapter directory (no {ADAPTER_CONFIG})")
    base_path = adapter_base(adapter_dir, base)
    task = adapter_config(adapter_dir).get("task_type")
    if task == "SEQ_CLS":  # a reward / cost model: one score per sequence; the adapter brings its head
        with quiet_load_report():
            model = AutoModelForSequenceClassification.from_pretrained(base_path, num_labels=1)
    elif is_vision_language(base_path):  # a LLaVA-family model (vlm_sft with model.lora): model + processor
        from transformers import AutoModelForImageTextToText, AutoProcessor

        model = AutoModelForImageTextToText.from_pretrained(base_path)
        merged = attach_adapter(model, adapter_dir, trainable=False).merge_and_unload()
        out.mkdir(parents=True, exist_ok=True)
        merged.save_pretrained(str(out), safe_serialization=True)
        src = adapter_dir if (adapter_dir / "processor_config.json").is_file() else Path(base_path)
        AutoProcessor.from_pretrained(str(src)).save_pretrained(str(out))
        return out
    else:
        model = AutoModelForCausalLM.from_pretrained(base_path)
    merged = attach_adapter(model, adapter_dir, trainable=False).merge_and_unload()
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(out), safe_serialization=True)
    tok_src = adapter_dir if (adapter_dir / "tokenizer_config.json").is_file() else Path(base_path)
    try:
        AutoTokenizer.from_pretrained(str(tok_src)).save_pretrained(str(out))
    except (OSError, ValueError):  # a base without a tokenizer: the model alone is still useful
        pass
    return out


def is_vision_language(path: str | Path) -> bool:
    """Whether the model at ``path`` has a vision tower (its config has a ``vision_config``)."""
    from transformers import AutoConfig

    try:
        return hasattr(AutoConfig.from_pretrained(str(path)), "vision_config")
    except (OSError, ValueError):
        return False


def load_lm(cfg: Any, *, name_or_path: str | None = None, dtype: Any = None, trainable: bool = True) -> nn.Module:
    """``load_causal_lm`` that also accepts a LoRA adapter directory (e.g. a trained DPO policy).

    For an adapter directory the base is loaded without new adapters and the saved adapter is
    attached (trainable or not); otherwise this is exactly ``load_causal_lm``.
    """
    path = name_or_path or cfg.name_or_path
    dtype = dtype or torch.float32
    if not is_adapter_dir(path):
        return load_causal_lm(cfg, name_or_path=path, dtype=dtype, trainable=trainable)
    base = load_causal_lm(dataclasses.replace(cfg, lora=None), name_or_path=adapter_base(path), dtype=dtype, trainable=trainable)
    if trainable and cfg.gradient_checkpointing:
        base.enable_input_require_grads()
    return attach_adapter(base, path, trainable=trainable)
