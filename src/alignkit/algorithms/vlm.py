"""LLaVA-style vision-language training: ``algorithm: vlm_sft`` with ``vlm.stage: pretrain | sft``.

The same next-token loss as SFT on assistant tokens (image and prompt tokens carry none) over image-text
rows; a stage only decides which parts of the model train (ALGORITHMS.md section 5): ``pretrain`` the
projector alone (vision tower and language model frozen), ``sft`` the projector and the language model
(in full, or through LoRA with ``model.lora``; the vision tower too with ``vlm.train_vision_tower``).
Frozen parts are frozen before the Strategy sees the model, so no engine holds optimizer state or syncs
gradients for them. ``vlm.projector_from`` starts the sft stage from a pretrain run's projector.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal, Optional

from alignkit.algorithms.base import Context, Example, OfflineAlgorithm
from alignkit.algorithms.sft import SFT
from alignkit.config.schema import RunConfig, f
from alignkit.config.sections import register_section
from alignkit.data.vlm import VLMData
from alignkit.errors import ConfigError
from alignkit.models.adapter_dirs import adapter_base, is_adapter_dir
from alignkit.models.roles import ModelSpec
from alignkit.models.sources import model_errors
from alignkit.models.vlm import describe_trainable, is_vlm_source

log = logging.getLogger("alignkit")


@register_section("vlm")
@dataclass
class VLMConfig:
    stage: Literal["pretrain", "sft"] = f(
        "sft", "pretrain: train the projector only (feature alignment); sft: projector + language model "
        "(visual instruction tuning). `alignkit train CFG --stage pretrain` sets it too.")
    train_vision_tower: bool = f(False, "sft: train the vision tower as well (frozen by default, as in LLaVA-1.5).")
    projector_from: Optional[str] = f(
        None, "A pretrain run's final/ (or checkpoint role folder, or LLaVA's mm_projector.bin) whose projector "
        "replaces the model's before training; null = the model's own.")
    loss_on: Literal["assistant", "all"] = f("assistant", "Train on assistant tokens, or on every text token "
                                                           "(image tokens never carry loss).")
    logps_chunk_size: int = f(
        0, "Rows of hidden states per LM-head chunk in the loss; 0 = chosen by memory "
        "(512 MiB of float32 logits per chunk on a GPU, 32 MiB on a CPU).", ge=0)

    def __post_init__(self) -> None:
        if self.stage == "pretrain" and self.train_vision_tower:
            raise ConfigError("vlm.train_vision_tower: the pretrain stage trains the projector only; "
                              "set vlm.stage=sft to train the vision tower")

    def train_parts(self) -> tuple[str, ...]:
        if self.stage == "pretrain":
            return ("projector",)
        return ("projector", "language_model") + (("vision_tower",) if self.train_vision_tower else ())


def load_processor(cfg: RunConfig) -> Any:
    """The model's processor (image processor + tokenizer with the image token); a pad token if it has none."""
    from transformers import AutoProcessor

    source = cfg.model.tokenizer or cfg.model.name_or_path
    with model_errors(source):
        try:
            processor = AutoProcessor.from_pretrained(source, trust_remote_code=cfg.model.trust_remote_code)
        except (OSError, ValueError):
            if not is_adapter_dir(source):
                raise
            processor = AutoProcessor.from_pretrained(adapter_base(source), trust_remote_code=cfg.model.trust_remote_code)
    if not hasattr(processor, "image_processor") or getattr(processor, "image_token_id", None) is None:
        raise ConfigError(f"model.name_or_path: {source} has no image processor with an image token; vlm_sft needs a "
                          "vision-language model (e.g. `alignkit tiny-model OUT --arch llava`)")
    tok = processor.tokenizer
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # pad positions never reach the loss
    return processor


def is_vision_language(cfg: RunConfig) -> bool:
    """Whether the run's model is a vision-language model (LLaVA family): then preference rows may carry
    images and the models are built as VLMs (reward / cost models with a score head on LLaVA)."""
    return is_vlm_source(cfg.model.name_or_path, cfg.model.trust_remote_code)


def vlm_spec_options(cfg: RunConfig, kind: str = "vlm") -> dict[str, Any]:
    """``ModelSpec`` options of a trainable vision-language model: the parts ``vlm`` says train (the vision
    tower frozen unless ``vlm.train_vision_tower``) and ``vlm.projector_from``; {} for a text model."""
    if not is_vision_language(cfg):
        return {}
    opts: dict[str, Any] = {"train_parts": cfg.section(VLMConfig).train_parts()}
    if kind == "vlm":
        opts["projector_from"] = cfg.section(VLMConfig).projector_from
    elif cfg.section(VLMConfig).projector_from:
        raise ConfigError("vlm.projector_from: applies to a generating model (vlm_sft, the DPO family), "
                          "not to a reward / cost model")
    return opts


def preference_inputs(cfg: RunConfig, tokenizer: Any) -> tuple[Any, Any]:
    """(what a checkpoint saves beside the weights, the processor or None) of a preference algorithm: the
    processor of a vision-language model (its rows may carry images), else the tokenizer and None."""
    if not is_vision_language(cfg):
        return tokenizer, None
    processor = load_processor(cfg)
    return processor, processor


class VLMSFT(SFT):
    """SFT's loss and evaluation over image-text rows (``VLMData``); the stage decides what trains."""

    name = "vlm_sft"
    config_sections = ("vlm",)

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        processor = load_processor(cfg)
        # the processor is what a checkpoint saves beside the weights (tokenizer + image processor)
        OfflineAlgorithm.__init__(self, cfg, processor, VLMData(processor, cfg.data, loss_on=cfg.section(VLMConfig).loss_on))

    @classmethod
    def model_specs(cls, cfg: RunConfig) -> list[ModelSpec]:
        v = cfg.section(VLMConfig)
        if v.stage == "pretrain" and cfg.model.lora is not None:
            raise ConfigError("model.lora: the pretrain stage trains the projector only; LoRA applies to vlm.stage=sft")
        return [ModelSpec("policy", cfg.model.name_or_path, "vlm", trainable=True, lora=cfg.model.lora is not None,
                          chunk_size=v.logps_chunk_size, train_parts=v.train_parts(), projector_from=v.projector_from)]

    def before_training(self, ctx: Context, train_set: list[Example], eval_set: list[Example]) -> None:
        if ctx.strategy.is_main:
            v = self.cfg.section(VLMConfig)
            src = f", projector from {v.projector_from}" if v.projector_from else ""
            log.info(f"VLM stage {v.stage}{src}: {describe_trainable(ctx.strategy.unwrap(ctx.models['policy']))}")
