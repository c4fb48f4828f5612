"""Architecture numbers of a diffusers MMDiT pipeline (SD3 class) for the memory estimator, without weights.

Each component's ``config.json`` is read (a local directory, or a hub id through the same config-only
download ``AutoConfig`` / ``load_config`` do for LMs) and the component is instantiated from it on the
``meta`` device, so parameter counts are exact and nothing is allocated. The transformer is what trains
(fully, or through LoRA on its attention projections); the VAE and the text encoders ride along frozen,
held in the compute dtype next to it (not inside the trained module: no engine shards them).

:class:`PipelineDims` is a :class:`~alignkit.planner.model_dims.ModelDims` (so the estimator's strategy,
ZeRO-3 unit and table code read it unchanged) whose ``n_params`` is the transformer's, plus the frozen
parts, the token geometry (VAE downsampling, patch size, CLIP positions) and every linear layer's shape for
exact LoRA counts (SD3's last block has no context output projection; SD3.5 adds a second attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

from alignkit.errors import ModelError
from alignkit.planner.model_dims import ModelDims

#: CLIP positions SD3 concatenates before the T5 tokens when a CLIP config does not say
CLIP_TOKENS = 77
#: pipeline components that hold no parameters or never load for training
_SKIP = ("scheduler", "tokenizer", "tokenizer_2", "tokenizer_3", "feature_extractor", "image_encoder",
         "transformer")


@dataclass(frozen=True)
class PipelineDims(ModelDims):
    """An MMDiT pipeline: ``n_params`` = the transformer's parameters; ``frozen_parts`` = VAE + text encoders + the
    transformer's buffers (SD3's 2D position table: 0.23B elements in SD3.5-medium, never trained); ``hidden`` =
    heads x head dim; ``n_layers`` = joint blocks.

    ``linears``: ``(module name, in_features, out_features)`` of every ``nn.Linear`` in the transformer;
    ``block_params``: the largest transformer block (ZeRO-3's gather unit).
    """

    lora_target_names: ClassVar[tuple[str, ...] | None] = None  # any linear's name (peft's suffix rule)
    vae_scale: int = 8
    patch_size: int = 2
    clip_tokens: int = CLIP_TOKENS
    block_params: int = 0
    dual_layers: int = 0  # SD3.5 blocks with a second (image-only) attention
    qk_norm: bool = False  # RMSNorm on q and k (SD3.5)
    linears: tuple[tuple[str, int, int], ...] = ()

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        return {name: (i, o) for name, i, o in self.linears}

    @property
    def layer_params(self) -> int:
        return self.block_params

    def lora_params(self, r: int, targets: Sequence[str]) -> int:
        """``sum r * (in + out)`` over the linears peft adapts for ``targets`` (its suffix match)."""
        return sum(r * (i + o) for name, i, o in self.linears if matches(name, targets))

    def tokens_per_image(self, resolution: int, max_sequence_length: int) -> int:
        """Tokens of one transformer forward: image patches + CLIP positions + T5 positions (SD3 concatenates
        them along the sequence)."""
        return self.image_tokens(resolution) + self.clip_tokens + max_sequence_length

    def image_tokens(self, resolution: int) -> int:
        """Patch tokens of a square ``resolution``-pixel image: ``(resolution / vae_scale / patch)^2``."""
        side = resolution // (self.vae_scale * self.patch_size)
        if side < 1:
            raise ValueError(f"resolution {resolution} is below one {self.vae_scale * self.patch_size}-pixel patch")
        return side * side


def matches(name: str, targets: Sequence[str]) -> bool:
    """peft's ``target_modules`` list rule: the module name equals a target or ends with ``.target``."""
    return any(name == t or name.endswith("." + t) for t in targets)


def _component_params(source: str, name: str, library: str, cls_name: str) -> tuple[int, Any]:
    """(parameter count, config) of one component built from its config on the meta device."""
    import torch

    lib = __import__(library)
    cls = getattr(lib, cls_name)
    if library == "transformers":
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(source, subfolder=name)
        with torch.device("meta"):
            model = cls._from_config(cfg)
    else:
        cfg = cls.load_config(source, subfolder=name)
        with torch.device("meta"):
            model = cls.from_config(cfg)
    return sum(p.numel() for p in model.parameters()), model


def _transformer_dims(model: Any, frozen_parts: int, vae_scale: int, clip_tokens: int) -> PipelineDims:
    from torch import nn

    c = model.config
    blocks = list(getattr(model, "transformer_blocks", []))
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no transformer_blocks (not an MMDiT)")
    hidden = c.num_attention_heads * c.attention_head_dim
    linears = tuple((n, m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, nn.Linear))
    return PipelineDims(
        n_params=sum(p.numel() for p in model.parameters()), n_layers=len(blocks), hidden=hidden,
        intermediate=4 * hidden, vocab=0, n_heads=c.num_attention_heads, n_kv_heads=c.num_attention_heads,
        tied_embeddings=False, head_dim=None, head="mmdit", vae_scale=vae_scale,
        frozen_parts=frozen_parts + sum(b.numel() for b in model.buffers()),  # SD3's position table is a buffer
        patch_size=c.patch_size, clip_tokens=clip_tokens,
        block_params=max(sum(p.numel() for p in b.parameters()) for b in blocks), linears=linears,
        dual_layers=sum(bool(getattr(b, "use_dual_attention", False)) for b in blocks),
        qk_norm=bool(getattr(c, "qk_norm", None)))


def pipeline_dims(source: str) -> PipelineDims:
    """:class:`PipelineDims` of the pipeline at ``source`` (directory or hub id); a one-line ModelError when its
    configs cannot be read."""
    try:
        from diffusers import DiffusionPipeline

        index = DiffusionPipeline.load_config(source)
        frozen, transformer, vae_scale, clip_tokens = 0, None, 8, CLIP_TOKENS
        for name, entry in index.items():
            if name.startswith("_") or not isinstance(entry, (list, tuple)) or None in entry:
                continue
            if name in _SKIP and name != "transformer":
                continue
            n, model = _component_params(source, name, entry[0], entry[1])
            if name == "transformer":
                transformer = model
                continue
            frozen += n
            if name == "vae":
                vae_scale = 2 ** (len(model.config.block_out_channels) - 1)
            if name == "text_encoder":
                clip_tokens = getattr(model.config, "max_position_embeddings", CLIP_TOKENS)
        if transformer is None:
            raise ValueError("model_index.json names no transformer (the diffusion kind trains MMDiT pipelines)")
        return _transformer_dims(transformer, frozen, vae_scale, clip_tokens)
    except ImportError:
        raise ModelError("model.kind: diffusion needs diffusers (pip install 'alignkit[image]')") from None
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot read the diffusion pipeline dimensions of {source!r} ({first}); give a "
                         "diffusers pipeline directory (model_index.json + component config.json) or hub id") from None
