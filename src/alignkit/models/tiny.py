"""Tiny random-init models with the tokenizer they were built for (``models/tiny_base.py``).

They let every test, demo and recipe run offline on a laptop CPU: ``build_tiny_model`` writes a
directory that plain ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``
load, exactly like a hub checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaForCausalLM

from alignkit.models.tiny_base import ARCHS, SIZES, _check_choice, tiny_config, train_tokenizer
from alignkit.models.tiny_sd3 import build_tiny_sd3
from alignkit.models.tiny_vlm import build_tiny_llava


def build_tiny_model(out_dir: str | Path, arch: str = "llama", size: str = "tiny",
                     vocab_size: int | None = None, seed: int = 0) -> Path:
    """Train a tokenizer, build a random-init causal LM and save both to ``out_dir`` (safetensors).

    Deterministic: the same arguments give identical tokenizer files and weights. Returns ``out_dir``.
    """
    _check_choice("arch", arch, ARCHS)
    _check_choice("size", size, SIZES)
    if arch == "llava":
        return build_tiny_llava(out_dir, size=size, vocab_size=vocab_size, seed=seed)
    if arch == "sd3":
        return build_tiny_sd3(out_dir, size=size, vocab_size=vocab_size, seed=seed)
    out = Path(out_dir)
    tokenizer = train_tokenizer(vocab_size or SIZES[size]["vocab_size"])
    config = tiny_config(tokenizer, size, arch)
    torch.manual_seed(seed)  # the weight init draws from the global generator
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
