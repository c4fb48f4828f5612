"""The VLM model adapter: which parts of a LLaVA-family model train, a projector from another run, LoRA
on the language model only, and the start-up line that says what trains.

A LLaVA model has three parts, told apart by parameter name (so peft-wrapped and older transformers
layouts work alike): the ``vision_tower`` (CLIP / SigLIP), the ``projector`` (``multi_modal_projector``:
vision features -> LM embeddings) and the ``language_model`` (decoder, embeddings and LM head).
LLaVA-1.5's stages (ALGORITHMS.md section 5): pretrain trains the projector alone; sft the projector
and the language model, the vision tower frozen unless asked. Frozen parameters have
``requires_grad=False`` before the Strategy sees the model, so they are neither in the optimizer nor
in DDP's gradient buckets.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from alignkit.config.schema import ModelConfig
from alignkit.errors import ModelError
from alignkit.models.adapter_dirs import adapter_base, is_adapter_dir
from alignkit.models.adapters import attach_adapter
from alignkit.models.loading import check_lora_targets, load_vlm, quiet_peft, upcast_trainable
from alignkit.models.sources import check_hub

PARTS: tuple[str, ...] = ("vision_tower", "projector", "language_model")
_VISION_KEYS = ("vision_tower.", "vision_model.")
_PROJECTOR_KEYS = ("multi_modal_projector.", "mm_projector.")


def part_of(name: str) -> str:
    """The part a parameter (by its full name) belongs to."""
    if any(k in name for k in _VISION_KEYS):
        return "vision_tower"
    if any(k in name for k in _PROJECTOR_KEYS):
        return "projector"
    return "language_model"


def unused_by_llava(model: nn.Module, name: str) -> bool:
    """Whether LLaVA's forward never uses this vision-tower parameter: the tower's pooling head
    (``post_layernorm``, SigLIP's ``head``) and the encoder layers after ``vision_feature_layer``
    (LLaVA-1.5 reads layer -2, so the last layer is unused). Trained, they would get no gradient,
    which DDP reports as an error; so they stay frozen."""
    if part_of(name) != "vision_tower":
        return False
    if ".post_layernorm." in name or ".head." in name:
        return True
    m = re.search(r"encoder\.layers\.(\d+)\.", name)
    cfg = getattr(model, "config", None)
    if m is None or cfg is None or not hasattr(cfg, "vision_config"):
        return False
    n_layers = cfg.vision_config.num_hidden_layers
    feature = getattr(cfg, "vision_feature_layer", -1)
    used = [f if f >= 0 else n_layers + 1 + f for f in (feature if isinstance(feature, list) else [feature])]
    return int(m.group(1)) >= max(used)  # hidden_states[k] is the output of layer k-1


def train_only(model: nn.Module, parts: Iterable[str]) -> None:
    """``requires_grad`` True exactly on the parameters of ``parts`` (a subset of :data:`PARTS`) that the
    forward uses (:func:`unused_by_llava`)."""
    keep = set(parts)
    unknown = keep - set(PARTS)
    if unknown:
        raise ValueError(f"unknown VLM parts {sorted(unknown)}; parts are {PARTS}")
    for name, p in model.named_parameters():
        p.requires_grad_(part_of(name) in keep and not unused_by_llava(model, name))


def part_counts(model: nn.Module) -> dict[str, tuple[int, int]]:
    """part -> (trainable, total) parameters."""
    out = {p: [0, 0] for p in PARTS}
    for name, p in model.named_parameters():
        c = out[part_of(name)]
        c[1] += p.numel()
        c[0] += p.numel() if p.requires_grad else 0
    return {k: (v[0], v[1]) for k, v in out.items()}


def describe_trainable(model: nn.Module) -> str:
    """``projector 8,256 of 8,256 trainable; language_model frozen (290,112); vision_tower frozen (...)``."""
    bits = []
    for part, (train, total) in part_counts(model).items():
        if train == 0:
            bits.append(f"{part} frozen ({total:,})")
        elif train == total:
            bits.append(f"{part} {train:,} trainable")
        else:  # LoRA adapters of a frozen base; a vision tower's unused pooling head
            bits.append(f"{part} {train:,} of {total:,} trainable")
    return "; ".join(bits)


# ------------------------------------------------------------------------------- projector weights
def _projector_key(key: str) -> str | None:
    """The key inside the projector module (``linear_1.weight``) of a saved tensor, or None."""
    if "original_module." in key:  # peft's frozen copy beside modules_to_save
        return None
    key = re.sub(r"modules_to_save\.[^.]+\.", "", key)
    for marker in _PROJECTOR_KEYS:
        if marker in key:
            inner = key.split(marker, 1)[1]
            if marker == "mm_projector.":  # the original LLaVA mm_projector.bin: an nn.Sequential (0, GELU, 2)
                inner = re.sub(r"^(\d+)\.", lambda m: f"linear_{int(m.group(1)) // 2 + 1}.", inner)
            return inner
    return None


def read_projector(source: str | Path) -> dict[str, torch.Tensor]:
    """The projector tensors of ``source``: a run's saved model or LoRA adapter directory (safetensors,
    sharded or not), or a ``.safetensors`` / ``mm_projector.bin`` file (the original LLaVA pretrain output)."""
    from safetensors import safe_open

    path = Path(source)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors")) or sorted(path.glob("mm_projector.bin"))
    elif path.is_file():
        files = [path]
    else:
        raise ModelError(f"vlm.projector_from: {source} does not exist")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        if f.suffix == ".bin":
            state = torch.load(f, map_location="cpu", weights_only=True)
            out.update({k2: v for k, v in state.items() if (k2 := _projector_key(k)) is not None})
            continue
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                inner = _projector_key(k)
                if inner is not None:
                    out[inner] = fh.get_tensor(k)
    if not out:
        raise ModelError(f"vlm.projector_from: no projector weights (multi_modal_projector.*) in {source}")
    return out


def projector_module(model: nn.Module) -> nn.Module:
    for name, module in model.named_modules():
        if name.endswith("multi_modal_projector"):
            return module
    raise ModelError(f"{type(model).__name__}: no multi_modal_projector module (not a LLaVA-family model?)")


def load_projector(model: nn.Module, source: str | Path) -> int:
    """Copy ``source``'s projector weights into ``model``'s projector; returns the number of tensors."""
    weights = read_projector(source)
    module = projector_module(model)
    own = module.state_dict()
    missing, extra = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    if missing or extra:
        raise ModelError(f"vlm.projector_from: {source} holds projector tensors {sorted(weights)}, the model's "
                         f"projector has {sorted(own)}")
    for k, v in weights.items():
        if v.shape != own[k].shape:
            raise ModelError(f"vlm.projector_from: {source}: {k} has shape {list(v.shape)}, the model's projector "
                             f"{list(own[k].shape)} (a projector of another vision tower or LM size?)")
    with torch.no_grad():
        for k, v in weights.items():
            own[k].copy_(v.to(own[k].dtype))
    return len(weights)


# ------------------------------------------------------------------------------- detection
@functools.lru_cache(maxsize=64)
def is_vlm_source(source: str, trust_remote_code: bool = False) -> bool:
    """Whether ``source`` (a model directory, hub id or LoRA adapter directory of one) is a vision-language
    model: its config has a ``vision_config``. False when the config cannot be read (the loader then says why)."""
    from transformers import AutoConfig

    if not source:  # no model named (alignkit estimate --preset)
        return False
    try:
        base = adapter_base(source) if is_adapter_dir(source) else source
        # a hub id (or a local path not made yet, e.g. a recipe's runs/tiny-model) while the Hub cannot be reached:
        # no answer at once, not huggingface_hub's minute of retries (a config check asks this before any load)
        check_hub(base)
        config = AutoConfig.from_pretrained(base, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, ModelError):
        return False
    return getattr(config, "vision_config", None) is not None


@functools.lru_cache(maxsize=16)
def part_params(source: str, trust_remote_code: bool = False) -> dict[str, int]:
    """part -> parameters of the LLaVA-family model at ``source`` (its config built on the meta device:
    no weights read), for the memory estimator."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(adapter_base(source) if is_adapter_dir(source) else source,
                                        trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config, trust_remote_code=trust_remote_code)
    return {part: total for part, (_, total) in part_counts(model).items()}


def image_free_anchor(model: nn.Module, inputs: dict[str, Any], device: torch.device) -> torch.Tensor | None:
    """For a batch WITHOUT images through a VLM whose projector trains: 0 x the projector's output on a zero
    input, to add to the loss path. The projector then takes part in every backward (with a zero
    gradient), as DDP requires of every trained parameter (otherwise a text-only micro-batch breaks the
    next step's gradient reduction); the module is called, so FSDP / ZeRO-3 gather it as usual. None for
    text models, batches with images, or no grad."""
    if "pixel_values" in inputs or not torch.is_grad_enabled():
        return None
    proj = getattr(model, "_alignkit_projector", False)
    if proj is False:  # looked up once per model
        proj = next((m for n, m in model.named_modules() if n.endswith("multi_modal_projector")), None)
        object.__setattr__(model, "_alignkit_projector", proj)
    if proj is None or not any(p.requires_grad for p in proj.parameters()):
        return None
    first = next(m for m in proj.modules() if isinstance(m, nn.Linear))
    x = torch.zeros(1, first.in_features, device=device, dtype=first.weight.dtype)
    return proj(x).sum() * 0.0


# ------------------------------------------------------------------------------- scalar head
def register_llava_scorer() -> None:
    """Make ``AutoModelForSequenceClassification`` build :class:`LlavaForSequenceClassification` for LLaVA
    configs (transformers has no LLaVA scoring model): reward / cost models of image + text. A saved one
    loads back through the same Auto class once alignkit is imported."""
    from transformers import AutoModelForSequenceClassification, LlavaConfig

    if LlavaConfig not in AutoModelForSequenceClassification._model_mapping._extra_content:
        AutoModelForSequenceClassification.register(LlavaConfig, _llava_scorer_class(), exist_ok=True)


@functools.cache
def _llava_scorer_class() -> type:
    from transformers.modeling_outputs import SequenceClassifierOutputWithPast
    from transformers.models.llava.modeling_llava import LlavaModel, LlavaPreTrainedModel

    class LlavaForSequenceClassification(LlavaPreTrainedModel):
        """LLaVA's backbone (vision tower, projector, language model) and a linear ``score`` head: one score
        per sequence, read at its last non-pad token (alignkit's ScalarHeadModel reads the backbone's
        hidden states itself, at each packed sequence's end)."""

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.model = LlavaModel(config)
            self.score = nn.Linear(config.text_config.hidden_size, config.num_labels, bias=False)
            self.post_init()

        def get_input_embeddings(self) -> nn.Module:
            return self.model.get_input_embeddings()

        def forward(self, input_ids: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                    attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
            out = self.model(input_ids=input_ids, pixel_values=pixel_values, attention_mask=attention_mask, **kwargs)
            logits = self.score(out.last_hidden_state)  # (B, T, num_labels)
            if attention_mask is None:
                last = torch.full((logits.shape[0],), logits.shape[1] - 1, device=logits.device)
            else:  # the last attended position of each row (right padding)
                last = attention_mask.shape[1] - 1 - attention_mask.flip(-1).long().argmax(-1)
            return SequenceClassifierOutputWithPast(logits=logits[torch.arange(logits.shape[0]), last])

    return LlavaForSequenceClassification


# ------------------------------------------------------------------------------- building
def lora_on_language_model(model: nn.Module, cfg: ModelConfig, also_train: Iterable[str],
                           task_type: str | None = None) -> nn.Module:
    """peft LoRA on the language model's ``cfg.lora.target_modules`` only (CLIP has q/k/v_proj too), with
    the other trained parts (projector, vision tower) as peft ``modules_to_save``: trained in full and
    saved with the adapter (``task_type`` SEQ_CLS adds the score head)."""
    from peft import LoraConfig, get_peft_model

    assert cfg.lora is not None
    check_lora_targets(model, cfg.lora.target_modules, ((n, m) for n, m in model.named_modules() if "language_model" in n))
    targets = "|".join(re.escape(t) for t in cfg.lora.target_modules)
    saved = {"projector": "multi_modal_projector", "vision_tower": "vision_tower"}
    lcfg = LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                      target_modules=rf".*language_model.*\.({targets})$", task_type=task_type,
                      modules_to_save=[saved[p] for p in also_train if p in saved] or None)
    if cfg.gradient_checkpointing:
        model.enable_input_require_grads()
    with quiet_peft():
        return upcast_trainable(get_peft_model(model, lcfg))


def load_vlm_model(cfg: ModelConfig, source: str, dtype: torch.dtype, *, trainable: bool,
                   train_parts: tuple[str, ...] | None = None, projector_from: str | None = None,
                   lora: bool = False) -> nn.Module:
    """A LLaVA-family model from ``source`` (a model directory / hub id, or a LoRA adapter directory of one).

    Trainable: ``projector_from`` replaces its projector; then only ``train_parts`` (None: all) train;
    with ``lora`` the language model trains through new LoRA adapters instead of in full.
    """
    plain = dataclasses.replace(cfg, lora=None)  # our own LoRA below: on the language model only
    if is_adapter_dir(source):  # e.g. a LoRA sft stage's final/: base + its adapter (and projector copy)
        base = load_vlm(plain, name_or_path=adapter_base(source), dtype=dtype, trainable=trainable)
        return attach_adapter(base, source, trainable=trainable)
    model = load_vlm(plain, name_or_path=source, dtype=dtype, trainable=trainable)
    if not trainable:
        return model
    if projector_from:
        load_projector(model, projector_from)
    parts = tuple(train_parts) if train_parts is not None else PARTS
    if lora and cfg.lora is not None:
        train_only(model, ())
        return lora_on_language_model(model, cfg, [p for p in parts if p != "language_model"])
    train_only(model, parts)
    return model
