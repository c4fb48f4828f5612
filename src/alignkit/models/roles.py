"""Models as declared roles.

An algorithm lists the models it needs as :class:`ModelSpec` s (``policy`` / ``reference`` /
``reward`` / ``cost`` / ``value`` / ``target``; ``kind`` lm | scalar | vlm; trainable or frozen). The
runner builds each through the :data:`BUILDERS` registry of its kind, hands trainable ones to the
Strategy (one handle each) and frozen ones to ``Strategy.prepare_frozen``, and gives the algorithm
the resulting :class:`Models` bundle. The memory planner sizes the same specs, so nothing under
``distributed/`` names an algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn

from alignkit.config.schema import ModelConfig
from alignkit.registry import Registry

if TYPE_CHECKING:
    from alignkit.distributed.strategy.base import Handle

ROLES = ("policy", "reference", "reward", "cost", "value", "cost_value", "target")
KINDS = ("lm", "scalar", "vlm")


@dataclass(frozen=True)
class ModelSpec:
    """One model a run needs.

    ``source``: hub id, local directory or LoRA adapter directory. ``lora``: trained through new or
    loaded LoRA adapters (the planner counts only the adapters as trained). ``transient``: loaded only
    before training (e.g. to precompute reference log-probs) and freed before the first step.
    ``shares``: the role is served by another role's weights (``"policy"``: the policy's LoRA base
    with adapters off), so nothing is loaded for it. ``chunk_size``: rows of hidden states per
    LM-head chunk (``lm``/``vlm``). ``train_parts`` (``vlm``): the parts that train (``vision_tower``,
    ``projector``, ``language_model``; None = all, or for a vision-language ``scalar`` model the projector
and language model), the rest frozen before the Strategy sees the model.
    ``projector_from`` (``vlm``): a directory or file whose projector weights replace the loaded ones
    (a pretrain stage's output).
    """

    role: str
    source: str
    kind: str = "lm"
    trainable: bool = False
    lora: bool = False
    transient: bool = False
    shares: str | None = None
    chunk_size: int = 1024
    train_parts: tuple[str, ...] | None = None
    projector_from: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"ModelSpec.role must be one of {ROLES}, got {self.role!r}")
        if self.kind not in KINDS:
            raise ValueError(f"ModelSpec.kind must be one of {KINDS}, got {self.kind!r}")
        if self.trainable and (self.transient or self.shares):
            raise ValueError("a trainable model cannot be transient or share another role's weights")
        if self.kind == "lm" and (self.train_parts is not None or self.projector_from):
            raise ValueError("train_parts / projector_from apply to a vlm (or a vision-language scalar) model only")
        if self.kind == "scalar" and self.projector_from:
            raise ValueError("projector_from applies to a vlm model only")

    @property
    def loaded(self) -> bool:
        """Whether the runner loads weights for this role (not when it shares another's)."""
        return self.shares is None


@dataclass(frozen=True)
class Workload:
    """What a run puts on the devices, as the memory planner needs it: the model specs and how many
    sequences one example puts through the trainable model (2 for a chosen/rejected pair)."""

    specs: tuple[ModelSpec, ...]
    sequences_per_example: int = 1

    @property
    def trainable(self) -> list[ModelSpec]:
        return [s for s in self.specs if s.trainable]

    @property
    def frozen(self) -> list[ModelSpec]:
        """Frozen models that are loaded (held all run, or transient)."""
        return [s for s in self.specs if not s.trainable and s.loaded]


#: kind -> builder(spec, model config, dtype, tokenizer) -> the module algorithms call
Builder = Callable[[ModelSpec, ModelConfig, torch.dtype, Any], nn.Module]
BUILDERS: Registry[Builder] = Registry("model kind")


@BUILDERS.register("lm")
def build_lm(spec: ModelSpec, cfg: ModelConfig, dtype: torch.dtype, tokenizer: Any) -> nn.Module:
    """A causal LM whose forward returns per-token log-probs (:class:`CausalLMLogps`)."""
    from alignkit.models.adapters import load_lm
    from alignkit.models.policy import CausalLMLogps

    lm = load_lm(cfg, name_or_path=spec.source, dtype=dtype, trainable=spec.trainable)
    return CausalLMLogps(lm, chunk_size=spec.chunk_size)


@BUILDERS.register("scalar")
def build_scalar(spec: ModelSpec, cfg: ModelConfig, dtype: torch.dtype, tokenizer: Any) -> nn.Module:
    """A sequence-scoring model (reward / cost / value head) returning one score per sequence."""
    from alignkit.models.scalar import ScalarHeadModel, load_scalar_model

    pad = getattr(tokenizer, "pad_token_id", None)
    return ScalarHeadModel(load_scalar_model(cfg, name_or_path=spec.source, dtype=dtype, trainable=spec.trainable,
                                             pad_token_id=pad, train_parts=spec.train_parts))


@BUILDERS.register("vlm")
def build_vlm(spec: ModelSpec, cfg: ModelConfig, dtype: torch.dtype, tokenizer: Any) -> nn.Module:
    """A vision-language model (LLaVA family) with the same log-prob forward as ``lm``: its batches carry
    ``pixel_values`` (and ``image_sizes``, ...), which ``forward_logps`` passes through to the backbone."""
    from alignkit.models.policy import CausalLMLogps
    from alignkit.models.vlm import load_vlm_model

    model = load_vlm_model(cfg, spec.source, dtype, trainable=spec.trainable, train_parts=spec.train_parts,
                           projector_from=spec.projector_from, lora=spec.lora)
    return CausalLMLogps(model, chunk_size=spec.chunk_size)


def build_model(spec: ModelSpec, cfg: ModelConfig, dtype: torch.dtype, tokenizer: Any) -> nn.Module:
    """The model of ``spec``; a missing / unreachable model or a corrupt weights file is one ModelError line."""
    from alignkit.models.sources import model_errors

    with model_errors(spec.source):
        return BUILDERS.get(spec.kind)(spec, cfg, dtype, tokenizer)


@dataclass
class Models:
    """A run's models by role: trainable ones as Strategy handles (``handles[role].module`` is what
    forward calls: the DDP / FSDP module or DeepSpeed engine), frozen ones as placed modules."""

    handles: dict[str, Handle] = field(default_factory=dict)
    frozen: dict[str, nn.Module] = field(default_factory=dict)

    def __getitem__(self, role: str) -> nn.Module:
        if role in self.handles:
            return self.handles[role].module
        if role in self.frozen:
            return self.frozen[role]
        raise KeyError(f"no model with role {role!r} in this run (have {sorted([*self.handles, *self.frozen])})")

    def __contains__(self, role: object) -> bool:
        return role in self.handles or role in self.frozen

    def get(self, role: str) -> nn.Module | None:
        return self[role] if role in self else None

    @property
    def primary(self) -> str:
        """The first trainable role (its weights are the run's ``final/``)."""
        return next(iter(self.handles))

    @property
    def trainable(self) -> nn.Module:
        """The module of the primary trainable role (what a one-model algorithm trains)."""
        return self.handles[self.primary].module

    def free(self, role: str) -> None:
        """Drop a frozen model (e.g. a reference whose log-probs are cached)."""
        self.frozen.pop(role, None)

    def train(self, mode: bool = True) -> None:
        for h in self.handles.values():
            h.module.train(mode)

    def __iter__(self) -> Iterator[str]:
        return iter([*self.handles, *self.frozen])
