"""A diffusers flow-matching text-to-image pipeline (SD3 class) as a trainable module: the ``diffusion`` kind's.

:class:`FlowPolicy` holds the pipeline's transformer as its one submodule, so the Strategy, the optimizer and
the state dict see the transformer alone (with LoRA: its adapters train, its base is frozen); the VAE, the text
encoders, the tokenizers and the scheduler ride along as ``pipe`` (frozen, eval mode, moved with the module).
Its forward is the transformer's velocity prediction; :meth:`FlowPolicy.encode_text` and
:meth:`FlowPolicy.encode_images` give what the flow-matching losses feed it (no gradient through the frozen
parts).

Saving is diffusers' format: with LoRA the adapter alone (``pytorch_lora_weights.safetensors``, which
``pipe.load_lora_weights(dir)`` loads), else the whole pipeline with the trained transformer
(``StableDiffusion3Pipeline.from_pretrained(dir)`` loads it); :meth:`FlowPolicy.load_saved` reads either back
for a resume.
"""

from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from alignkit.errors import ModelError
from alignkit.models.weights import read_safetensors_dir

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
#: what LoRA targets in an SD3 transformer when ``model.lora.target_modules`` keeps the LM default
#: (the attention projections, as diffusers' SD3 LoRA scripts and flow_grpo do)
SD3_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
LM_LORA_DEFAULT = ["q_proj", "k_proj", "v_proj", "o_proj"]


#: what diffusers and transformers print on every load of a pipeline here and is known to be harmless: the image
#: processors the SD3 pipeline module names fall back to their PIL twins without torchvision (an alignkit pipeline
#: has none), and a LoRA trained on the transformer alone has no keys for the text encoders
HARMLESS = re.compile(r"`\w+` requires torchvision \(not installed\); falling back to `\w+Pil`"
                      r"|No LoRA keys associated to \w+ found with the prefix")


class _DropHarmless(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not HARMLESS.search(record.getMessage())


@contextlib.contextmanager
def quiet_diffusers() -> Iterator[None]:
    """For the block (importing a pipeline class, loading a pipeline or a LoRA): diffusers' progress bars off
    ("Loading pipeline components...", into every log; alignkit says what it loaded) and the :data:`HARMLESS`
    warnings dropped from the two libraries' handlers; every other warning passes, and both are restored after."""
    try:
        from diffusers.utils import logging as diffusers_logging
    except ImportError:  # a diffusers without its logging utilities (a stand-in): nothing of its to quiet
        yield
        return
    from transformers.utils import logging as transformers_logging

    diffusers_logging.get_verbosity()  # each library adds its handler on first use: they exist from here on
    transformers_logging.get_verbosity()
    handlers = [h for name in ("diffusers", "transformers") for h in logging.getLogger(name).handlers]
    bars, drop = diffusers_logging.is_progress_bar_enabled(), _DropHarmless()
    diffusers_logging.disable_progress_bar()
    for h in handlers:
        h.addFilter(drop)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(drop)
        if bars:
            diffusers_logging.enable_progress_bar()


def load_pipeline(source: str, dtype: torch.dtype) -> Any:
    """The pipeline at ``source`` (hub id or directory; needs diffusers), quietly (:func:`quiet_diffusers`), its
    progress bars off."""
    try:
        import diffusers
    except ImportError:
        raise ModelError("model.kind: diffusion needs diffusers (pip install 'alignkit[image]')") from None
    with quiet_diffusers():
        pipe = diffusers.DiffusionPipeline.from_pretrained(source, dtype=dtype)
    if getattr(pipe, "transformer", None) is None:
        raise ModelError(f"{source}: a {type(pipe).__name__} has no transformer; the diffusion kind trains "
                         "flow-matching transformer pipelines (SD3 class)")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def lora_targets(requested: Any, names: Any) -> list[str]:
    """The ``target_modules`` given to peft: ``requested`` (the LM default means :data:`SD3_LORA_TARGETS`) less those
    naming none of the module ``names`` (peft's suffix rule); the estimator counts the adapters with the same list."""
    targets = list(requested)
    if targets == LM_LORA_DEFAULT:
        targets = SD3_LORA_TARGETS
    names = set(names)
    kept = [t for t in targets if any(n == t or n.endswith("." + t) for n in names)]
    if not kept:
        raise ModelError(f"model.lora.target_modules {list(requested)} name no module of the transformer "
                         f"(e.g. {', '.join(SD3_LORA_TARGETS[:4])})")
    return kept


def add_lora(transformer: nn.Module, lora: Any) -> None:
    """Freeze ``transformer`` and add trainable LoRA adapters (peft, through diffusers' ``add_adapter``)."""
    from peft import LoraConfig

    targets = lora_targets(lora.target_modules, [n for n, _ in transformer.named_modules()])
    transformer.requires_grad_(False)
    transformer.add_adapter(LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                       init_lora_weights="gaussian", target_modules=targets))
    for p in transformer.parameters():  # the adapters train in fp32 whatever the base's dtype
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()


class FlowPolicy(nn.Module):
    """A flow-matching pipeline whose transformer trains (module docstring)."""

    def __init__(self, pipe: Any, *, lora: bool) -> None:
        super().__init__()
        self.transformer = pipe.transformer
        self.lora = lora
        self.negatives: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}  # :meth:`negative`'s
        object.__setattr__(self, "pipe", pipe)  # not a submodule: its frozen parts stay out of the state dict
        for name, part in pipe.components.items():
            if isinstance(part, nn.Module) and name != "transformer":
                part.requires_grad_(False)
                part.eval()

    @contextlib.contextmanager
    def disable_adapter(self) -> Iterator[None]:
        """Run as the LoRA base: the transformer's adapters off for the duration (diffusers' ``disable_adapters``),
        the ``lora_base`` reference of Flow-GRPO's KL term."""
        self.transformer.disable_adapters()
        try:
            yield
        finally:
            self.transformer.enable_adapters()

    def frozen_parts(self) -> list[nn.Module]:
        return [p for n, p in self.pipe.components.items() if isinstance(p, nn.Module) and n != "transformer"]

    def _apply(self, fn: Any, recurse: bool = True) -> "FlowPolicy":
        super()._apply(fn, recurse)
        self.negatives.clear()  # encoded where the encoders were
        for part in self.frozen_parts():  # .to(device) moves the VAE and text encoders too
            part._apply(fn, recurse)
        return self

    def forward(self, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                pooled_prompt_embeds: torch.Tensor) -> torch.Tensor:
        """The predicted velocity ``(B, C, h, w)`` at ``latents`` ``(B, C, h, w)`` and ``timestep`` ``(B,)``
        (the scheduler's scale: sigma * 1000)."""
        return self.transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=prompt_embeds,
                                pooled_projections=pooled_prompt_embeds, return_dict=False)[0]

    @torch.no_grad()
    def encode_text(self, prompts: list[str], max_sequence_length: int = 77) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B, L, D)`` prompt embeddings and ``(B, P)`` pooled ones, as the pipeline conditions on them."""
        embeds, _, pooled, _ = self.pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None,
                                                       do_classifier_free_guidance=False,
                                                       max_sequence_length=max_sequence_length,
                                                       device=self.transformer.device)
        return embeds, pooled

    def negative(self, prompt: str, max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(1, L, D)`` and ``(1, P)`` embeddings of classifier-free guidance's negative ``prompt``: the
        frozen encoders' output, computed once (per device: a move clears it)."""
        key = (prompt, max_sequence_length)
        if key not in self.negatives:
            self.negatives[key] = self.encode_text([prompt], max_sequence_length)
        return self.negatives[key]

    @torch.no_grad()
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """``(B, C, h, w)`` scaled latents of ``pixels`` ``(B, 3, H, W)`` in [-1, 1]: the VAE posterior's mean
        (deterministic, so a resumed run sees the same latents), shifted and scaled as SD3 does."""
        vae = self.pipe.vae
        latents = vae.encode(pixels.to(vae.device, vae.dtype)).latent_dist.mode()
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        return ((latents - shift) * vae.config.scaling_factor).to(self.transformer.dtype)

    def save_pretrained(self, out_dir: str, state_dict: dict[str, torch.Tensor] | None = None,
                        safe_serialization: bool = True) -> None:
        """diffusers' format: the LoRA adapter alone, or the pipeline with this transformer (``state_dict``: the
        gathered weights of this module, from a sharding engine)."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        weights = {k.removeprefix("transformer."): v for k, v in (state_dict or self.state_dict()).items()}
        if self.lora:
            from peft.utils import get_peft_model_state_dict

            layers = get_peft_model_state_dict(self.transformer, state_dict=weights)
            meta = self.transformer.peft_config["default"].to_dict()  # rank and alpha: the scaling diffusers loads
            type(self.pipe).save_lora_weights(str(out), transformer_lora_layers=layers, safe_serialization=True,
                                              transformer_lora_adapter_metadata=meta)
            return
        from safetensors.torch import save_file

        # the pipeline's parts one by one: the live transformer may be a shard, so its weights come from ``weights``
        for name, part in self.pipe.components.items():
            if part is not None and name != "transformer":
                part.save_pretrained(str(out / name))
        self.pipe.save_config(str(out))  # model_index.json
        self.transformer.save_config(str(out / "transformer"))
        save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()},
                  str(out / "transformer" / "diffusion_pytorch_model.safetensors"))

    def load_saved(self, path: str | Path) -> None:
        """Weights written by :meth:`save_pretrained` copied back in place (a resume)."""
        path = Path(path)
        if self.lora:
            from peft.utils import set_peft_model_state_dict
            from safetensors.torch import load_file

            saved = load_file(str(path / LORA_WEIGHTS))
            set_peft_model_state_dict(self.transformer, {k.removeprefix("transformer."): v for k, v in saved.items()})
            return
        weights = read_safetensors_dir(path / "transformer")
        params = self.transformer.state_dict(keep_vars=True)
        missing = [k for k in params if k not in weights]
        if missing or len(weights) != len(params):
            raise ModelError(f"{path}: the saved transformer does not match this one (e.g. {missing[:2]})")
        with torch.no_grad():
            for k, v in weights.items():
                params[k].copy_(v.to(dtype=params[k].dtype, device=params[k].device))

