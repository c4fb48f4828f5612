"""What an algorithm supplies to the loops: the models it needs and the per-batch math.

An algorithm declares its models as roles (:meth:`Algorithm.model_specs`), gets them back as a
:class:`~alignkit.models.roles.Models` bundle (whose kind adapters compute log-probs, scores and
values), and its ``loss`` returns the loss of the trainable role (or a dict role -> loss when several
roles train); accumulation, normalisation, stepping, logging and checkpoints are the loops'. Hooks get
a :class:`Context` instead of keeping the models or the Strategy. An offline algorithm has a data
pipeline (``self.data``: rows -> examples -> micro-batches, and how many loss units a micro-batch
holds) by composition; an online one (``algorithms/online.py``) owns its rollout. The reference model
is resolved in one place (:func:`resolve_reference`, :func:`policy_specs`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Protocol

import torch

from alignkit.config.schema import RunConfig
from alignkit.config.sections import SECTIONS
from alignkit.data.batch import Batch
from alignkit.errors import ConfigError
from alignkit.metrics import MetricSums
from alignkit.models.adapter_dirs import is_adapter_dir
from alignkit.models.kinds import KINDS
from alignkit.models.roles import ImageShape, Models, ModelSpec

if TYPE_CHECKING:
    from alignkit.data.io import RowCounts
    from alignkit.distributed.strategy.base import Strategy

Example = dict[str, Any]


class DataPipeline(Protocol):
    """Rows -> examples -> micro-batches for one algorithm (``data/`` supplies the implementations)."""

    #: rows dropped per split ("train" / "eval"): skipped by ``data.skip_invalid`` or with nothing to learn
    skipped: dict[str, int]
    #: per split, the rows dropped or changed (e.g. truncated) by cause, for the start-up log
    row_counts: dict[str, RowCounts]

    def build_dataset(self, specs: list[str], split: str) -> list[Example]:
        """Tokenized examples of the files in ``specs`` (``split`` is 'train' or 'eval')."""

    def collate(self, examples: list[Example]) -> Batch:
        """A micro-batch of tensors from a list of examples."""

    def loss_units(self, batch: Batch) -> int:
        """How many loss units (tokens or sequences) this micro-batch holds."""

    def tokens_in(self, batch: Batch) -> int:
        """Non-pad tokens processed (for tokens/s)."""


@dataclass
class Context:
    """What a hook sees: the run's models and Strategy, the optimizer step reached, and that step's (or
    iteration's) metrics reduced over every rank and micro-batch. Algorithms keep no reference to it."""

    models: Models
    strategy: Strategy
    step: int = 0
    metrics: Mapping[str, float] = field(default_factory=dict)


class Algorithm(ABC):
    """The one algorithm base: declared models, the per-micro-batch loss, hooks with a :class:`Context`,
    and state a checkpoint carries. Offline algorithms add ``data`` and ``eval_step``; online ones
    (``algorithms/online.py``) add ``rollout``. The loops own accumulation, normalisation, stepping,
    logging and checkpoints."""

    name: str = "base"
    #: sequences one example puts through the trainable model (2 for a chosen/rejected pair)
    sequences_per_example: int = 1
    #: metrics the console step line shows first, after a 1-based "Epoch E step N" (seed-guide lines)
    console_keys: tuple[str, ...] = ()
    #: log the estimator's per-component memory table at start-up (runs holding several models)
    memory_table: bool = False
    #: config sections this class reads besides the one named like it (``rollout`` for every online algorithm);
    #: subclasses add to their bases' (:meth:`own_sections`)
    config_sections: tuple[str, ...] = ()

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        self.cfg = cfg
        #: the policy's tokenizer, or a vision-language model's processor
        self.tokenizer = tokenizer

    @classmethod
    def own_sections(cls) -> list[str]:
        """The registered config sections this algorithm reads: over its class and its bases, the section
        named like each (``safe_dpo`` extends ``dpo``: both) and those each declares in ``config_sections``.
        ``alignkit validate`` prints these and leaves out other algorithms' sections."""
        names: list[str] = []
        for klass in reversed(cls.__mro__):
            names += [klass.__dict__.get("name", ""), *klass.__dict__.get("config_sections", ())]
        return [n for n in dict.fromkeys(names) if n in SECTIONS]

    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        """Settings this algorithm cannot train with although each key is valid alone: raise a one-line
        ``ConfigError``. Called at config load (so ``alignkit validate`` says it too), before anything is read."""

    @classmethod
    def reserved_memory_fraction(cls, cfg: RunConfig) -> float:
        """Share of each accelerator's memory the run holds outside its models (a colocated rollout engine);
        the memory planner leaves it out of what the training state may use."""
        return 0.0

    @classmethod
    def image_shape(cls, cfg: RunConfig) -> ImageShape | None:
        """What one trained forward of the run's diffusion policy sees (the memory planner's tokens); None when
        no diffusion model trains."""
        return None

    @classmethod
    @abstractmethod
    def model_specs(cls, cfg: RunConfig) -> list[ModelSpec]:
        """The models this run needs, trainable ones first (the first is the run's ``final/``)."""

    @abstractmethod
    def loss(self, models: Models, batch: Batch, *, normalizer: float) -> tuple[torch.Tensor | dict[str, torch.Tensor], MetricSums]:
        """Loss of one micro-batch, already divided by ``normalizer`` (global units / dp_size): one
        tensor for the trainable role, or ``{role: loss}`` when several roles train."""

    def before_training(self, ctx: Context, train_set: list[Example], eval_set: list[Example]) -> None:
        """Called once by either loop, after the models are built and placed, before the first step (and
        before a resume restores weights); ``train_set`` / ``eval_set``: the examples (offline) or prompt rows
        (online). E.g. DPO caches reference log-probs in the examples; online algorithms zero dropout."""

    def before_step(self, ctx: Context, group: list[Batch]) -> None:
        """Called by the offline loop before it accumulates an optimizer step's micro-batches (this rank's,
        still on the host): a statistic of the whole step that every micro-batch's loss shares (KTO's
        reference point z0). Every rank calls it at the same point, so it may reduce across ranks (``comm``)."""

    def on_step_end(self, ctx: Context) -> dict[str, float]:
        """After each optimizer step (offline) or each iteration's updates (online), with ``ctx.metrics``
        reduced over every rank (e.g. a dual update); returns extra metrics to log."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Algorithm state that a checkpoint must carry (e.g. a Lagrange multiplier)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class OfflineAlgorithm(Algorithm):
    """An algorithm of the offline loop (SFT, reward/cost models, the DPO family, ...): a data pipeline
    by composition and an evaluation step."""

    def __init__(self, cfg: RunConfig, tokenizer: Any, data: DataPipeline) -> None:
        super().__init__(cfg, tokenizer)
        self.data = data

    @abstractmethod
    def eval_step(self, models: Models, batch: Batch) -> MetricSums:
        """Evaluation metric sums of one micro-batch (no grad)."""


# ---------------------------------------------------------------------- the reference, once
def policy_has_lora(cfg: RunConfig) -> bool:
    return cfg.model.lora is not None or is_adapter_dir(cfg.model.name_or_path)


def resolve_reference(cfg: RunConfig, choice: str, *, needed: bool, key: str, why: str = "") -> str:
    """The reference an algorithm's ``key`` (``auto`` | ``model`` | ``lora_base`` | ``none``) resolves to:
    ``none`` when not ``needed``; ``auto`` = the LoRA base (adapters off) with LoRA and no
    ``model.ref_name_or_path``, else a frozen ``model``. ``why``: what needs it, for the error."""
    if choice == "none" or not needed:
        if choice == "none" and needed:
            raise ConfigError(f"{key}=none: {why or 'this algorithm'} needs reference log-probs")
        return "none"
    if choice == "auto":
        return "lora_base" if policy_has_lora(cfg) and not cfg.model.ref_name_or_path else "model"
    if choice == "lora_base" and not policy_has_lora(cfg):
        raise ConfigError(f"{key}=lora_base needs LoRA adapters (set model.lora)")
    return choice


def policy_specs(cfg: RunConfig, reference: str, *, kind: str = "lm", transient_reference: bool = False,
                 chunk_size: int = 0, **options: Any) -> list[ModelSpec]:
    """The trainable policy and, for ``reference`` ``model`` / ``lora_base``, its reference role (a frozen
    copy, or the policy's weights with adapters off: :meth:`Models.running` serves it)."""
    m = cfg.model
    if m.kind != "auto":  # a kind chosen by name (a plugin's, say) over the algorithm's default
        kind = m.kind
        if kind not in KINDS:
            try:
                KINDS.get(kind)
            except KeyError as e:  # the registry's line: the closest name and every choice
                raise ConfigError(f"model.kind: {e.args[0]}") from None
    specs = [ModelSpec("policy", m.name_or_path, kind, trainable=True, lora=policy_has_lora(cfg),
                       chunk_size=chunk_size, **options)]
    if reference == "model":
        specs.append(ModelSpec("reference", m.ref_name_or_path or m.name_or_path, kind,
                               transient=transient_reference, chunk_size=chunk_size))
    elif reference == "lora_base":
        specs.append(ModelSpec("reference", m.name_or_path, kind, shares="policy", transient=transient_reference))
    return specs
