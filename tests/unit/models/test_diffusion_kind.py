"""The ``diffusion`` model kind on the tiny SD3 pipeline: what trains, what saves (diffusers' format, LoRA alone
where LoRA) and what a resume reads back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from alignkit.config.schema import LoraConfig, ModelConfig
from alignkit.models.kinds import KINDS
from alignkit.models.roles import ModelSpec
from alignkit.models.weights import load_weights_into

pytest.importorskip("diffusers")


def build(path: Path, *, lora: bool) -> torch.nn.Module:
    cfg = ModelConfig(name_or_path=str(path), lora=LoraConfig(r=4, alpha=8.0, dropout=0.0) if lora else None)
    spec = ModelSpec("policy", str(path), "diffusion", trainable=True, lora=lora)
    return KINDS.get("diffusion").build(spec, cfg, torch.float32, None)


def velocity(module: torch.nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    embeds, pooled = module.encode_text(["a red circle in the top left"], max_sequence_length=4)
    latents = torch.randn(1, 4, 16, 16, generator=g)
    with torch.no_grad():
        return module(latents, torch.tensor([500.0]), embeds, pooled)


def perturb(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(0.05)


def test_full_transformer_trains_and_saves_a_pipeline_diffusers_loads(micro_sd3: Path, tmp_path: Path) -> None:
    from diffusers import StableDiffusion3Pipeline

    module = build(micro_sd3, lora=False)
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    assert names and all(n.startswith("transformer.") for n in names)  # VAE and text encoders: not parameters here
    assert not any(p.requires_grad for p in module.pipe.vae.parameters())
    tok = KINDS.get("diffusion").tokenizer(ModelConfig(name_or_path=str(micro_sd3)))
    assert tok("a circle")["input_ids"][-1] == tok.eos_token_id
    perturb(module)
    before = velocity(module)
    module.save_pretrained(str(tmp_path / "out"))
    pipe = StableDiffusion3Pipeline.from_pretrained(tmp_path / "out")
    assert all(torch.equal(a, b) for a, b in zip(pipe.transformer.state_dict().values(),
                                                 module.transformer.state_dict().values()))
    fresh = build(micro_sd3, lora=False)
    assert not torch.allclose(velocity(fresh), before)
    load_weights_into(fresh, tmp_path / "out")  # a resume
    assert torch.equal(velocity(fresh), before)


def test_lora_trains_adapters_only_and_saves_them_alone(micro_sd3: Path, tmp_path: Path) -> None:
    from diffusers import StableDiffusion3Pipeline

    module = build(micro_sd3, lora=True)
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    base = velocity(module)
    perturb(module)
    before = velocity(module)
    assert not torch.allclose(base, before)
    module.save_pretrained(str(tmp_path / "lora"))
    assert sorted(p.name for p in (tmp_path / "lora").iterdir()) == ["pytorch_lora_weights.safetensors"]
    pipe = StableDiffusion3Pipeline.from_pretrained(micro_sd3)  # diffusers' own LoRA loading reads it
    pipe.load_lora_weights(str(tmp_path / "lora"))
    fresh = build(micro_sd3, lora=True)
    load_weights_into(fresh, tmp_path / "lora")  # a resume
    assert torch.allclose(velocity(fresh), before, atol=1e-6)
    g = torch.Generator().manual_seed(0)
    embeds, pooled = module.encode_text(["a red circle in the top left"], max_sequence_length=4)
    with torch.no_grad():
        got = pipe.transformer(hidden_states=torch.randn(1, 4, 16, 16, generator=g), timestep=torch.tensor([500.0]),
                               encoder_hidden_states=embeds, pooled_projections=pooled, return_dict=False)[0]
    assert torch.allclose(got, before, atol=1e-5)


def test_the_module_moves_its_frozen_parts_along() -> None:
    # dtype stands in for a device: .to() reaches the VAE and text encoders, which are no submodules
    from diffusers import StableDiffusion3Pipeline

    from alignkit.models.diffusion import FlowPolicy
    from alignkit.models.tiny_sd3 import tiny_sd3_parts

    torch.manual_seed(0)
    module = FlowPolicy(StableDiffusion3Pipeline(**tiny_sd3_parts("micro")), lora=False).to(torch.float64)
    assert module.pipe.vae.dtype == torch.float64 and module.pipe.text_encoder.dtype == torch.float64
