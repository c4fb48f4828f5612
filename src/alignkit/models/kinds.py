"""Model kinds: one adapter per kind of model owns what algorithms and the loops ask of it.

A :class:`ModelSpec`'s ``kind`` names an entry of :data:`KINDS`. The adapter builds the module, and is
the one place that knows how such a module computes log-probs of given outputs (a policy), scores or
per-token values (a scalar head), samples outputs (token models through the run's rollout engine, the
diffusion kind with its own sampler) and its dimensions for the memory estimator. A role's tokenizer is its spec's (``roles.role_tokenizer``).
Algorithms call these through :class:`~alignkit.models.roles.Models` (``models.logps("policy", batch)``),
never a token helper directly, so a new kind (a diffusers pipeline, a non-token toy policy) is one
adapter registered here and no algorithm changes.

Kinds shipped: ``lm`` (a causal LM returning per-token log-probs), ``scalar`` (reward / cost / value
head), ``vlm`` (a LLaVA-family model with the ``lm`` forward; its batches carry ``pixel_values``),
``diffusion`` (a diffusers flow-matching text-to-image pipeline whose transformer trains:
:mod:`alignkit.models.diffusion`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from alignkit.config.schema import ModelConfig
from alignkit.data.batch import Batch
from alignkit.errors import ModelError
from alignkit.models import diffusion_sample
from alignkit.models.adapters import load_lm
from alignkit.models.diffusion import FlowPolicy, add_lora, load_pipeline
from alignkit.models.dims import resolve_dims
from alignkit.models.generation import Generations, SamplingParams, TokenGenerator
from alignkit.models.loading import hf_model, load_tokenizer
from alignkit.models.policy import CausalLMLogps, forward_logps, forward_scores, token_values
from alignkit.models.scalar import ScalarHeadModel, load_scalar_model
from alignkit.models.sources import check_model_folder, model_errors
from alignkit.models.vlm import load_vlm_model
from alignkit.planner.pipeline_dims import pipeline_dims
from alignkit.registry import Registry

if TYPE_CHECKING:
    from alignkit.models.roles import ModelSpec
    from alignkit.planner.model_dims import ModelDims


class ModelKind:
    """What a kind of model offers; a kind overrides what it supports (the rest say so in one line).

    Saving is a protocol of the module :meth:`build` returns (or of the Hugging Face model it wraps as
    ``hf_model``): ``save_pretrained(out_dir, state_dict=..., safe_serialization=True)`` in its ecosystem's
    format, as transformers, peft and diffusers models have it; the Strategy gathers the weights (FSDP2,
    ZeRO-3) and calls it on rank 0, and a resume loads the safetensors back into the module."""

    name = "kind"

    def build(self, spec: ModelSpec, cfg: ModelConfig, dtype: torch.dtype, tokenizer: Any) -> nn.Module:
        raise NotImplementedError(f"model kind {self.name!r} does not build models")

    def check_source(self, source: str) -> None:
        """A one-line ModelError where the local folder ``source`` cannot hold a model of this kind, said before
        any tokenizer, data or weights load; by default nothing (a plugin kind saves in a format of its own)."""

    def tokenizer(self, cfg: ModelConfig) -> Any:
        """The tokenizer (or processor) a run with this kind as its policy reads its data with; by default
        ``model.tokenizer`` or the model's own (a diffusers kind would read its pipeline's)."""
        return load_tokenizer(cfg)

    def logps(self, module: nn.Module, batch: Batch, *, temperature: float = 1.0,
              with_entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``(N,)`` log-probs of the batch's given outputs (``targets``), row-major over scored positions, under
        the model's distribution at ``temperature`` (online algorithms pass the sampler's; 1.0 = the model's
        own, and must give exactly the untempered numbers); with ``with_entropy`` the pair (log-probs, ``(N,)``
        exact entropies of that distribution at the same positions, no gradient: a metric)."""
        raise TypeError(f"a {self.name!r} model has no log-probs (it is not a policy)")

    def scores(self, module: nn.Module, batch: Batch) -> torch.Tensor:
        """``(S,)`` one scalar per sequence (reward / cost models)."""
        raise TypeError(f"a {self.name!r} model gives no sequence scores")

    def values(self, module: nn.Module, batch: Batch) -> torch.Tensor:
        """``(N,)`` a value per scored position, aligned with :meth:`logps` (a PPO critic)."""
        raise TypeError(f"a {self.name!r} model gives no per-token values")

    def generate(self, module: nn.Module, engine: TokenGenerator, prompts: list[Any], params: Any, *,
                 synced: bool = False) -> Any:
        """Sample one output per prompt from the plain (unwrapped, gathered) ``module``: a token kind's
        :class:`~alignkit.models.generation.Generations` of ``SamplingParams`` from the run's ``engine`` (any
        :class:`~alignkit.models.generation.TokenGenerator`), the diffusion kind's images
        (:class:`~alignkit.models.diffusion_sample.ImageGenerations` of ``FlowSampling``)."""
        raise TypeError(f"a {self.name!r} model cannot generate")

    def dims(self, spec: ModelSpec, trust_remote_code: bool) -> ModelDims:
        """The estimator's architecture numbers; ValueError where the kind cannot say."""
        raise ValueError(f"model kind {self.name!r} gives no dimensions to the memory estimator")


KINDS: Registry[ModelKind] = Registry("model kind")


def register_kind(name: str) -> Any:
    """Class decorator: ``@register_kind("mine")`` registers an instance of the adapter under ``name``."""

    def wrap(cls: type[ModelKind]) -> type[ModelKind]:
        cls.name = name
        KINDS.register(name)(cls())
        return cls

    return wrap


@register_kind("lm")
class CausalLMKind(ModelKind):
    """A causal LM whose forward returns per-token log-probs (:class:`~alignkit.models.policy.CausalLMLogps`)."""

    def check_source(self, source: str) -> None:
        """A transformers model or peft adapter folder (config.json or adapter_config.json, and weights)."""
        check_model_folder(source)

    def build(self, spec: ModelSpec, cfg: ModelConfig, dtype: torch.dtype, tokenizer: Any) -> nn.Module:
        lm = load_lm(cfg, name_or_path=spec.source, dtype=dtype, trainable=spec.trainable)
        return CausalLMLogps(lm, chunk_size=spec.chunk_size)

    def logps(self, module: nn.Module, batch: Batch, *, temperature: float = 1.0, with_entropy: bool = False,
              full_vocab: bool = False, on_hidden: Any = None) -> Any:
        """With ``full_vocab``: ``(N, V)`` log-probs of the whole distribution at each target position; with
        ``on_hidden`` its value on the final hidden states there and the LM head's weight (``CausalLMLogps``)."""
        return forward_logps(module, batch, temperature=temperature, with_entropy=with_entropy, full_vocab=full_vocab,
                             on_hidden=on_hidden)

    def generate(self, module: nn.Module, engine: TokenGenerator, prompts: list[Any], params: SamplingParams, *,
                 synced: bool = False) -> Generations:
        return engine.generate(hf_model(module), prompts, params, synced=synced)

    def dims(self, spec: ModelSpec, trust_remote_code: bool) -> ModelDims:
        return resolve_dims(spec.source, trust_remote_code)


@register_kind("vlm")
class VisionLMKind(CausalLMKind):
    """A vision-language model (LLaVA family) with the ``lm`` forward: its batches carry ``pixel_values``
    (and ``image_sizes``, ...) as declared model inputs, which the log-prob forward passes through."""

    def build(self, spec: ModelSpec, cfg: ModelConfig, dtype: torch.dtype, tokenizer: Any) -> nn.Module:
        model = load_vlm_model(cfg, spec.source, dtype, trainable=spec.trainable, train_parts=spec.train_parts,
                               projector_from=spec.projector_from, lora=spec.lora)
        return CausalLMLogps(model, chunk_size=spec.chunk_size)


@register_kind("scalar")
class ScalarKind(ModelKind):
    """A sequence-scoring model (reward / cost / value head) on an LM or VLM backbone."""

    check_source = CausalLMKind.check_source  # the same transformers folders

    def build(self, spec: ModelSpec, cfg: ModelConfig, dtype: torch.dtype, tokenizer: Any) -> nn.Module:
        pad = getattr(tokenizer, "pad_token_id", None)
        return ScalarHeadModel(load_scalar_model(cfg, name_or_path=spec.source, dtype=dtype, trainable=spec.trainable,
                                                 pad_token_id=pad, train_parts=spec.train_parts))

    def scores(self, module: nn.Module, batch: Batch) -> torch.Tensor:
        return forward_scores(module, batch)

    def values(self, module: nn.Module, batch: Batch) -> torch.Tensor:
        return token_values(module, batch)

    def dims(self, spec: ModelSpec, trust_remote_code: bool) -> ModelDims:
        d = resolve_dims(spec.source, trust_remote_code)
        return d.as_score_model() if d.head == "lm" else d


@register_kind("diffusion")
class DiffusionKind(ModelKind):
    """A diffusers flow-matching text-to-image pipeline (SD3 class) by hub id or directory: the module is a
    :class:`~alignkit.models.diffusion.FlowPolicy` whose transformer trains (LoRA adapters with ``model.lora``,
    else all of it) and which saves in diffusers' format; its tokenizer is the pipeline's first CLIP one. It
    samples with its own SDE / ODE sampler and gives the log-probs of stored transitions
    (:mod:`alignkit.models.diffusion_sample`)."""

    def generate(self, module: nn.Module, engine: TokenGenerator, prompts: list[Any], params: Any, *,
                 synced: bool = False) -> Any:
        """``ImageGenerations`` of :class:`~alignkit.models.diffusion_sample.ImagePrompt` s under ``params`` (a
        ``FlowSampling``): images, the trajectory with each SDE step's log-prob, the conditioning. The token engine
        is not used (no engine samples a flow SDE; a sharded module steps every rank alike, as it draws a fixed
        number of steps), nor its autocast: the sampler runs in the pipeline's dtypes."""
        device = next(module.parameters()).device
        with torch.autocast(device.type, enabled=False):
            return diffusion_sample.generate(module, prompts, params)

    def logps(self, module: nn.Module, batch: Batch, *, temperature: float = 1.0, with_entropy: bool = False,
              params: Any = None, with_step: bool = False) -> Any:
        """``(B,)`` log-probs of the batch's stored transitions (``next_latents`` from ``latents``, per element
        mean: Flow-GRPO's) under ``module`` and the sampler's ``params`` (a ``FlowSampling``; temperature has no
        meaning here); with ``with_entropy`` also the ``(B,)`` per-element entropy of each step's Gaussian, with
        ``with_step`` instead the whole :class:`~alignkit.ops.flow_sde.SDEStep` (the mean and noise scale
        Flow-GRPO's KL term reads)."""
        if not isinstance(params, diffusion_sample.FlowSampling) or temperature != 1.0:
            raise TypeError("a diffusion model's log-probs take the sampler's settings (params=FlowSampling(...)), "
                            "not a temperature")
        step = diffusion_sample.transition(module, batch, params)
        if with_step:
            return step
        if with_entropy:
            return step.logp, (torch.log(step.std) + 0.5 * math.log(2 * math.pi * math.e)).detach()
        return step.logp

    def build(self, spec: ModelSpec, cfg: ModelConfig, dtype: torch.dtype, tokenizer: Any) -> nn.Module:
        pipe = load_pipeline(spec.source, dtype)
        if spec.trainable and spec.lora:
            lora = spec.lora_config or cfg.lora
            if lora is None:
                raise ValueError("a LoRA diffusion policy needs model.lora (rank, alpha, target modules)")
            add_lora(pipe.transformer, lora)
        else:
            pipe.transformer.requires_grad_(spec.trainable)
            if spec.trainable:
                pipe.transformer.float()  # full training keeps fp32 master weights
        if spec.trainable and cfg.gradient_checkpointing:  # each joint block recomputed in backward
            pipe.transformer.enable_gradient_checkpointing()
        return FlowPolicy(pipe, lora=spec.trainable and spec.lora)

    def check_source(self, source: str) -> None:
        """A diffusers pipeline folder has model_index.json; a text model given to flow_grpo would otherwise fail
        reading its tokenizer, with a traceback that asks to install sentencepiece."""
        path = Path(source).expanduser()
        if path.is_dir() and not (path / "model_index.json").is_file():
            what = "a transformers model" if (path / "config.json").is_file() else "no model"
            raise ModelError(f"model {source!r}: not a diffusers pipeline folder (no model_index.json; it holds {what}): "
                             "this algorithm trains a text-to-image pipeline such as Stable Diffusion 3.5 (a hub id, or "
                             "`alignkit tiny-model --arch sd3 DIR` for a tiny one)")

    def dims(self, spec: ModelSpec, trust_remote_code: bool) -> ModelDims:
        """The pipeline's transformer (trained) and frozen parts, read from its component configs
        (:mod:`alignkit.planner.pipeline_dims`)."""
        return pipeline_dims(spec.source)

    def tokenizer(self, cfg: ModelConfig) -> Any:
        from transformers import AutoTokenizer

        source = cfg.tokenizer or cfg.name_or_path
        with model_errors(source):
            if cfg.tokenizer:
                return AutoTokenizer.from_pretrained(source)
            return AutoTokenizer.from_pretrained(source, subfolder="tokenizer")
